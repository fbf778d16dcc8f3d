"""The scheduler service in-process on a real nats-server: the node table from KV
and leadership between two replicas. (Dispatch, loss and cancel with a recorder
and agents are in tests/system.)"""

from __future__ import annotations

import asyncio
import datetime as dt
import time
from collections.abc import AsyncIterator, Callable

import pytest
from structlog.testing import capture_logs

from lorafleet.log import Event
from lorafleet.names import KV_DEL, Header
from lorafleet.nats import _bus as bus
from lorafleet.settings import Settings
from lorafleet_schemas.messages import Heartbeat, NodeList, NodeListRequest
from lorafleet_services.scheduler.leadership import LEADER_KEY
from lorafleet_services.scheduler.service import Scheduler
from tests.eventually import eventually


@pytest.fixture
def fast(settings: Settings) -> Settings:
    return settings.with_(heartbeat_s=0.25, node_timeout_s=1, request_timeout_s=0.5)


async def _scheduler(settings: Settings, name: str) -> Scheduler:
    nc = await bus.connect(settings, name)
    await bus.ensure_layout(nc.jetstream(), bus.layout_for(settings))
    s = Scheduler(nc, settings, instance=name)
    await s.start()
    return s


@pytest.fixture
async def pair(fast: Settings) -> AsyncIterator[list[Scheduler]]:
    schedulers = [await _scheduler(fast, "s1"), await _scheduler(fast, "s2")]
    try:
        yield schedulers
    finally:
        for s in schedulers:
            await s.stop()
            await bus.drain_quietly(s.nc)


async def _seconds_until(check: Callable[[], object], what: str, timeout_s: float) -> float:
    """Wait (polling every 20 ms) until `check()` is true; the seconds it took."""
    t0 = time.monotonic()
    await eventually(check, what, timeout_s=timeout_s, interval_s=0.02)
    return time.monotonic() - t0


async def test_one_of_two_replicas_leads(pair: list[Scheduler]) -> None:
    await _seconds_until(lambda: any(s.is_leader() for s in pair), "a leader", 5)
    for _ in range(50):  # 1 s: renewals keep the same leader, never two
        assert sum(s.is_leader() for s in pair) == 1
        await asyncio.sleep(0.02)
    kv = await pair[0].js.key_value(pair[0].names.leader_bucket)
    entry = await kv.get(LEADER_KEY)
    leader = next(s for s in pair if s.is_leader())
    assert entry.value == leader.instance.encode()


async def test_the_other_takes_over_when_the_leader_dies(pair: list[Scheduler]) -> None:
    await _seconds_until(lambda: any(s.is_leader() for s in pair), "a leader", 5)
    leader = next(s for s in pair if s.is_leader())
    other = next(s for s in pair if s is not leader)
    # A crash: no clean hand-over, no more renewals; the key must expire.
    # The crashed replica still believes it leads until its lease runs out.
    assert leader.leadership._task is not None and leader._rounds is not None
    leader.leadership._task.cancel()
    leader._rounds.cancel()
    await leader.nc.close()
    both: list[bool] = []

    def taken() -> bool:
        both.append(leader.is_leader() and other.is_leader())
        return other.is_leader()

    took_s = await _seconds_until(taken, "the follower to lead", bus.LEADER_TTL_S + 3)
    # The key expires LEADER_TTL_S (3 s, the node timeout) after the last
    # renewal; the follower acts on the expiry marker (measured: ~3.0 s).
    assert took_s <= bus.LEADER_TTL_S + 1.0
    assert not any(both)


async def test_a_clean_stop_hands_over_at_once(pair: list[Scheduler]) -> None:
    await _seconds_until(lambda: any(s.is_leader() for s in pair), "a leader", 5)
    leader = next(s for s in pair if s.is_leader())
    other = next(s for s in pair if s is not leader)
    await leader.stop()
    took_s = await _seconds_until(other.is_leader, "the follower to lead", 3)
    assert took_s < 1.0  # the deleted key, not its TTL


async def test_nodes_list_follows_beats_and_their_expiry(pair: list[Scheduler]) -> None:
    s = pair[0]
    subject = s.names.node_heartbeat("gpu-7")
    beat = Heartbeat(
        node="gpu-7",
        version="t",
        started_at=dt.datetime.now(dt.UTC),
        time=dt.datetime.now(dt.UTC),
    )
    await s.js.publish(subject, bus.encode(beat), msg_ttl=s.settings.node_timeout_s)

    async def listed() -> NodeList:
        return await bus.request(s.nc, s.names.nodes_list, NodeListRequest(), NodeList)

    # Either replica answers nodes.list: both must have seen the beat.
    await _seconds_until(
        lambda: all("gpu-7" in r.nodes.table.nodes for r in pair), "the node in both", 5
    )
    (info,) = (await listed()).nodes
    assert info.alive and info.heartbeat.node == "gpu-7"
    # No more beats: the per-message TTL expires and the leader's marker marks
    # it lost at once; the other replica (no lease) waits a node timeout more
    # for a beat (nodes.py, issue 33), and then loses it too.
    timeout_s = s.settings.node_timeout_s
    await _seconds_until(lambda: any(r.is_leader() for r in pair), "a leader", 5)
    leader = next(r for r in pair if r.is_leader())
    lost_s = await _seconds_until(
        lambda: not leader.nodes.table.nodes["gpu-7"].alive, "the node lost", 5
    )
    assert lost_s <= timeout_s + 1.0
    await _seconds_until(
        lambda: not any(r.nodes.table.nodes["gpu-7"].alive for r in pair),
        "the node lost by both",
        2 * timeout_s + 2,
    )
    (info,) = (await listed()).nodes
    assert not info.alive


async def test_a_deleted_heartbeat_reads_as_a_clean_stop_not_an_expiry(fast: Settings) -> None:
    with capture_logs() as logs:
        s = await _scheduler(fast, "s1")
        try:
            beat = Heartbeat(
                node="gpu-8",
                version="t",
                started_at=dt.datetime.now(dt.UTC),
                time=dt.datetime.now(dt.UTC),
            )
            subject = s.names.node_heartbeat("gpu-8")
            await s.js.publish(subject, bus.encode(beat), msg_ttl=60)
            await eventually(
                lambda: "gpu-8" in s.nodes.table.nodes, "the node in the table", timeout_s=5
            )
            # What an agent's clean stop publishes (a KV delete).
            await s.js.publish(subject, b"", headers={Header.KV_OPERATION: KV_DEL})
            await eventually(
                lambda: not s.nodes.table.nodes["gpu-8"].alive, "the node gone", timeout_s=5
            )
        finally:
            await s.stop()
            await bus.drain_quietly(s.nc)
    about = [e for e in logs if e.get("node") == "gpu-8" and e["event"] != Event.NODE_UP]
    assert [e["event"] for e in about] == ["node.left"]
    assert about[0]["message"].startswith("stopped cleanly (heartbeat deleted)")
