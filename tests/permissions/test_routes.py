"""Each identity answers what its service serves and nothing another serves:
the subjects come from the services' own routes, so a new endpoint without
its permission (or given to the wrong identity) fails here, not on a
deployed server."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from nats.aio.client import Client

from lorafleet.access.permissions import allows, identity_block
from lorafleet.names import Names
from lorafleet.settings import Settings
from lorafleet_services.agent.config import AgentConfig
from lorafleet_services.agent.service import Agent
from lorafleet_services.artifact_store.api import ArtifactApi
from lorafleet_services.recorder.api import RecorderApi
from lorafleet_services.scheduler.service import Scheduler

NAMES = Names()
NODE = "node-1"


def served(tmp_path: Path) -> dict[tuple[str, str], list[str]]:
    """(identity kind, name) -> the subjects that process answers."""
    nc = Client()  # never connected: the routes only name subjects
    settings = Settings()
    none: Any = None
    cfg = AgentConfig(node=NODE, work_dir=tmp_path / "w", engines_dir=tmp_path / "e")
    return {
        ("service", "recorder"): [r.subject for r in RecorderApi(none, NAMES, none, none).routes()],
        ("service", "scheduler"): [r.subject for r in Scheduler(nc, settings).routes()],
        ("service", "artifact-store"): [r.subject for r in ArtifactApi(none, NAMES).routes()],
        ("node", NODE): [r.subject for r in Agent(nc, nc.jetstream(), settings, cfg).routes()],
    }


async def test_every_service_may_answer_what_it_serves_and_nothing_another_does(
    tmp_path: Path,
) -> None:
    routes = served(tmp_path)
    assert all(routes.values()), routes
    for (kind, name), subjects in routes.items():
        block = identity_block(NAMES, kind, name)
        for subject in subjects:
            assert allows(block, "subscribe", subject), f"{kind}/{name} may not answer {subject}"
        for (other_kind, other), theirs in routes.items():
            if (other_kind, other) == (kind, name):
                continue
            for subject in theirs:
                assert not allows(block, "subscribe", subject), (
                    f"{kind}/{name} may answer {subject}, which {other_kind}/{other} serves"
                )


@pytest.mark.parametrize("client", ["cli"])
async def test_a_client_may_call_every_api_a_service_serves(tmp_path: Path, client: str) -> None:
    block = identity_block(NAMES, "client", client)
    for subjects in served(tmp_path).values():
        for subject in subjects:
            if subject.startswith(f"{NAMES.prefix}.api."):
                assert allows(block, "publish", subject), f"client/{client} may not call {subject}"
