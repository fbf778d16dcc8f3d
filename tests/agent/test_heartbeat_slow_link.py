"""A link too slow for a beat's ack or a PONG to come back within their
timeouts, while messages keep arriving over it, is not an unreachable
server (agent/heartbeat.py): otherwise an agent delivering its artifact over
a link its own chunks fill fences mid-delivery (tests/partition). A real
nats-server behind a relay that delays each direction by 0.6 s."""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path

from lorafleet.nats import _bus as bus
from lorafleet.nats.server import NatsServer
from lorafleet.settings import Settings
from lorafleet_services.agent.config import AgentConfig
from lorafleet_services.agent.heartbeat import (
    REACH_TIMEOUT_S,
    CardReader,
    Heartbeater,
    fence_bound_s,
)
from tests.partition.relay import relay_process

#: Seconds each direction is late: the round trip (1.2 s) outlasts the beat's
#: ack timeout (the 0.5 s heartbeat) and the PING's (REACH_TIMEOUT_S, 1 s).
DELAY_S = 0.6
BEATS = 3


async def test_messages_arriving_while_beats_time_out_mean_the_server_is_reached(
    tmp_path: Path,
) -> None:
    assert 2 * DELAY_S > REACH_TIMEOUT_S
    async with (
        NatsServer(tmp_path / "nats") as server,
        relay_process("127.0.0.1", server.host, server.port, DELAY_S) as relay_url,
    ):
        settings = Settings(nats_url=relay_url, heartbeat_s=0.5, node_timeout_s=3)
        nc = await bus.connect(settings, "agent-under-test")
        sender = await bus.connect(Settings(nats_url=server.url), "chunk-acks")
        hb = Heartbeater(
            nc.jetstream(),
            settings,
            AgentConfig(node="node-1", work_dir=tmp_path / "w", engines_dir=tmp_path / "e"),
            version="test",
            current_job=lambda: None,
            card_reader=CardReader(lambda: []),
        )

        async def acks() -> None:  # what a delivery's chunk acks are to the connection
            while True:
                await sender.publish("acks", b"+")
                await asyncio.sleep(0.05)

        sub = await nc.subscribe("acks")
        await nc.flush(timeout=5)
        feeding = asyncio.create_task(acks())
        loop = asyncio.get_running_loop()
        try:
            await asyncio.sleep(DELAY_S)  # the first messages are on their way
            for _ in range(BEATS):
                assert not await hb.beat()  # no bucket, and its answer late anyway
                unreachable_s = loop.time() - hb.last_reached
                assert unreachable_s < fence_bound_s(settings.node_timeout_s), unreachable_s
            assert sub.delivered > 0
        finally:
            feeding.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await feeding
            hb.cards.close()
            await bus.drain_quietly(sender)
            await nc.close()
