"""Fixtures for the artifact tests: a connection with the lorafleet layout."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
from nats.aio.client import Client

from lorafleet.bus import connect, drain_quietly, ensure_layout, layout_for
from lorafleet.settings import Settings


@pytest.fixture
async def nc(settings: Settings) -> AsyncIterator[Client]:
    client = await connect(settings, "test-artifacts")
    await ensure_layout(client.jetstream(), layout_for(settings))
    try:
        yield client
    finally:
        await drain_quietly(client)
