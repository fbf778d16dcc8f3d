"""Fixtures of the recorder tests: a session factory on each backend, a catalog model."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from lorafleet_schemas.messages import Engine, ModelSpec
from lorafleet_services.recorder import db, store
from lorafleet_services.recorder.db import Sessions


@pytest.fixture
async def sm(db_url: str) -> AsyncIterator[Sessions]:
    engine = db.create_engine(db_url)
    try:
        yield db.sessions(engine)
    finally:
        await engine.dispose()


@pytest.fixture
async def models(sm: Sessions) -> Sessions:
    """`sm` with two catalog models: tiny-vllm (vllm) and tiny-gguf (llamacpp)."""
    await store.add_model(sm, ModelSpec(name="tiny-vllm", engine=Engine.VLLM, hf_repo="x/tiny"))
    await store.add_model(
        sm, ModelSpec(name="tiny-gguf", engine=Engine.LLAMACPP, local_dir="/models/tiny")
    )
    return sm
