"""A beat the server answers but does not store moves the agent to another
server (agent/heartbeat.py): at most once per half node timeout, and never
with one server only. Real nats-servers with no heartbeat bucket, so that
every beat is answered "no responders" while the connection is fine; and a
frozen one (SIGSTOP), which answers nothing."""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from nats.aio.client import Client

from lorafleet.nats import _bus as bus
from lorafleet.nats.server import NatsServer
from lorafleet.settings import Settings
from lorafleet_services.agent.config import AgentConfig
from lorafleet_services.agent.heartbeat import CardReader, Heartbeater
from tests.eventually import eventually


@pytest.fixture
async def two_servers(tmp_path: Path) -> AsyncIterator[tuple[NatsServer, NatsServer]]:
    async with NatsServer(tmp_path / "a") as a, NatsServer(tmp_path / "b") as b:
        yield a, b


async def _heartbeater(
    settings: Settings, tmp_path: Path, **connect: Any
) -> tuple[Client, Heartbeater]:
    nc = await bus.connect(settings, "agent-under-test", **connect)
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


async def test_a_frozen_server_is_left_for_a_live_one_before_the_fence(tmp_path: Path) -> None:
    """bench/nemesis.py, seed 4: an agent on a frozen member fenced itself
    after "no other server took us": its one 1 s try came after a 1 s PING.
    Here the pool's next server is frozen too: the move tries it and then the
    live one, all before the agent's fence bound (last ack + node timeout)."""
    async with (
        NatsServer(tmp_path / "a") as a,
        NatsServer(tmp_path / "x") as x,
        NatsServer(tmp_path / "b") as b,
    ):
        urls = f"{a.url},{x.url},{b.url}"
        settings = Settings(nats_url=urls, heartbeat_s=0.5, node_timeout_s=2)
        nc, hb = await _heartbeater(settings, tmp_path, dont_randomize=True)
        frozen = [a.proc, x.proc]
        try:
            assert nc.connected_url is not None and nc.connected_url.netloc in a.url
            for proc in frozen:
                assert proc is not None
                os.kill(proc.pid, signal.SIGSTOP)
            assert not await hb.beat()
            loop = asyncio.get_running_loop()
            now = loop.time()
            assert hb.moves == 1 and nc.connected_url.netloc in b.url
            # On the live server before the bound: the scheduler has lost nobody.
            assert now - hb.last_ack < settings.node_timeout_s
        finally:
            for proc in frozen:
                assert proc is not None
                os.kill(proc.pid, signal.SIGCONT)
            hb.cards.close()
            await bus.drain_quietly(nc)
