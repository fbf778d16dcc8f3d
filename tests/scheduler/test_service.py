"""The scheduler service in-process on a real nats-server: the node table from KV
and leadership between two replicas. (Dispatch, loss and cancel with a recorder
and agents are in tests/system.)"""

from __future__ import annotations

import asyncio
import datetime as dt
import time
from collections.abc import AsyncIterator

import pytest

from lorafleet import bus
from lorafleet.settings import Settings
from lorafleet_schemas.messages import Heartbeat, NodeList, NodeListRequest
from lorafleet_services.scheduler.service import LEADER_KEY, Scheduler


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


async def _until(pred: object, timeout_s: float, what: str) -> float:
    """Poll `pred()` (a callable) until true; return the seconds it took."""
    assert callable(pred)
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        if pred():
            return time.monotonic() - t0
        await asyncio.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")


async def test_one_of_two_replicas_leads(pair: list[Scheduler]) -> None:
    await _until(lambda: any(s.is_leader() for s in pair), 5, "a leader")
    for _ in range(50):  # 1 s: renewals keep the same leader, never two
        assert sum(s.is_leader() for s in pair) == 1
        await asyncio.sleep(0.02)
    kv = await pair[0].js.key_value(pair[0].names.leader_bucket)
    entry = await kv.get(LEADER_KEY)
    leader = next(s for s in pair if s.is_leader())
    assert entry.value == leader.instance.encode()


async def test_the_other_takes_over_when_the_leader_dies(pair: list[Scheduler]) -> None:
    await _until(lambda: any(s.is_leader() for s in pair), 5, "a leader")
    leader = next(s for s in pair if s.is_leader())
    other = next(s for s in pair if s is not leader)
    # A crash: no clean hand-over, the key must expire.
    for t in leader._tasks:
        t.cancel()
    await leader.nc.close()
    both: list[bool] = []

    def taken() -> bool:
        both.append(leader.is_leader() and other.is_leader())
        return other.is_leader()

    took_s = await _until(taken, bus.LEADER_TTL_S + 3, "the follower to lead")
    # The key expires LEADER_TTL_S (3 s, the node timeout) after the last
    # renewal; the follower acts on the expiry marker (measured: ~3.0 s).
    assert took_s <= bus.LEADER_TTL_S + 1.0
    assert not any(both)


async def test_a_clean_stop_hands_over_at_once(pair: list[Scheduler]) -> None:
    await _until(lambda: any(s.is_leader() for s in pair), 5, "a leader")
    leader = next(s for s in pair if s.is_leader())
    other = next(s for s in pair if s is not leader)
    await leader.stop()
    took_s = await _until(other.is_leader, 3, "the follower to lead")
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
    await _until(lambda: all("gpu-7" in r.table.nodes for r in pair), 5, "the node in both")
    (info,) = (await listed()).nodes
    assert info.alive and info.heartbeat.node == "gpu-7"
    # No more beats: the per-message TTL expires and the marker marks it lost.
    lost_s = await _until(
        lambda: not any(r.table.nodes["gpu-7"].alive for r in pair), 5, "the node lost"
    )
    assert lost_s <= s.settings.node_timeout_s + 1.0
    (info,) = (await listed()).nodes
    assert not info.alive
