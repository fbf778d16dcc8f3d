"""A beat the server answers but does not store moves the agent to another
server (agent/heartbeat.py): at most once per half node timeout, and never
with one server only. Real nats-servers with no heartbeat bucket, so that
every beat is answered "no responders" while the connection is fine."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from nats.aio.client import Client

from lorafleet import _bus as bus
from lorafleet.natsserver import NatsServer
from lorafleet.settings import Settings
from lorafleet_services.agent.config import AgentConfig
from lorafleet_services.agent.heartbeat import CardReader, Heartbeater
from tests.eventually import eventually


@pytest.fixture
async def two_servers(tmp_path: Path) -> AsyncIterator[tuple[NatsServer, NatsServer]]:
    async with NatsServer(tmp_path / "a") as a, NatsServer(tmp_path / "b") as b:
        yield a, b


async def _heartbeater(settings: Settings, tmp_path: Path) -> tuple[Client, Heartbeater]:
    nc = await bus.connect(settings, "agent-under-test")
    cfg = AgentConfig(node="node-1", work_dir=tmp_path / "work", engines_dir=tmp_path / "engines")
    hb = Heartbeater(
        nc.jetstream(),
        settings,
        cfg,
        version="test",
        current_job=lambda: None,
        card_reader=CardReader(lambda: []),
    )
    return nc, hb


async def test_a_beat_answered_but_not_stored_moves_to_another_server(
    two_servers: tuple[NatsServer, NatsServer], tmp_path: Path
) -> None:
    a, b = two_servers
    settings = Settings(nats_url=f"{a.url},{b.url}", node_timeout_s=2)
    nc, hb = await _heartbeater(settings, tmp_path)
    try:
        first = nc.connected_url
        assert not await hb.beat()
        await eventually(
            lambda: nc.is_connected and nc.connected_url != first, "a connection to the other"
        )
        assert hb.moves == 1
        assert not await hb.beat()  # within half the node timeout: it stays
        assert hb.moves == 1
    finally:
        hb.cards.close()
        await bus.drain_quietly(nc)


async def test_with_one_server_there_is_nowhere_to_move(
    two_servers: tuple[NatsServer, NatsServer], tmp_path: Path
) -> None:
    a, _ = two_servers
    nc, hb = await _heartbeater(Settings(nats_url=a.url, node_timeout_s=2), tmp_path)
    try:
        assert not await hb.beat()
        assert hb.moves == 0 and nc.is_connected
    finally:
        hb.cards.close()
        await bus.drain_quietly(nc)
