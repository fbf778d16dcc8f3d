"""Leadership on a real nats-server, one step at a time, with a hand-driven clock."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

import pytest
import structlog
from nats.aio.client import Client
from structlog.testing import capture_logs

from lorafleet.log import Event
from lorafleet.nats import _bus as bus
from lorafleet.nats._bus import LEADER_TTL_S
from lorafleet.settings import Settings
from lorafleet_services.scheduler.leadership import LEADER_KEY, LEADER_SAFETY_S, Leadership
from tests.eventually import eventually
from tests.scheduler.clock import Clock


@pytest.fixture
async def nc(settings: Settings) -> AsyncIterator[Client]:
    nc = await bus.connect(settings, "leadership-test")
    await bus.ensure_layout(nc.jetstream(), bus.layout_for(settings))
    try:
        yield nc
    finally:
        await bus.drain_quietly(nc)


def replica(nc: Client, settings: Settings, name: str, clock: Clock) -> Leadership:
    return Leadership(nc.jetstream(), settings.names, name, structlog.get_logger(), clock)


async def key_value(nc: Client, settings: Settings) -> bytes | None:
    kv = await nc.jetstream().key_value(settings.names.leader_bucket)
    return (await kv.get(LEADER_KEY)).value


async def test_the_lease_ends_its_safety_margin_before_the_key_could_expire(
    nc: Client, settings: Settings
) -> None:
    clock = Clock(1000.0)
    acquired: list[float] = []
    a = replica(nc, settings, "a", clock)
    a.on_acquired = lambda: acquired.append(clock.now)
    await a.step()
    assert a.is_leader() and acquired == [1000.0]
    assert a.lease_until == 1000.0 + LEADER_TTL_S - LEADER_SAFETY_S
    assert await key_value(nc, settings) == b"a"
    clock.now = a.lease_until - 0.01
    assert a.is_leader()
    clock.now = a.lease_until
    assert not a.is_leader()  # no renewal in time: stop acting
    # A renewal extends the lease from when it was sent.
    await a.step()
    assert a.is_leader() and a.lease_until == clock.now + LEADER_TTL_S - LEADER_SAFETY_S
    assert acquired == [1000.0, clock.now]  # leading again after a gap counts


async def test_a_held_key_is_not_taken_and_renewals_keep_it(nc: Client, settings: Settings) -> None:
    clock = Clock(1000.0)
    a, b = replica(nc, settings, "a", clock), replica(nc, settings, "b", clock)
    await a.step()
    for _ in range(3):
        await b.step()
        await a.step()
        clock.now += 1.0
        assert a.is_leader() and not b.is_leader()
    assert await key_value(nc, settings) == b"a"


async def test_a_renewal_refused_loses_the_lease(nc: Client, settings: Settings) -> None:
    clock = Clock(1000.0)
    a, b = replica(nc, settings, "a", clock), replica(nc, settings, "b", clock)
    await a.step()
    # Behind a's back (its key expired while it was paused, say): b takes the key.
    kv = await nc.jetstream().key_value(settings.names.leader_bucket)
    await kv.delete(LEADER_KEY)
    await b.step()
    assert b.is_leader()
    with capture_logs() as logs:
        a.logger = structlog.get_logger()
        await a.step()
    assert not a.is_leader() and b.is_leader()
    assert logs[0]["event"] == Event.LEADER_LOST
    await a.step()  # and it does not take the key back while b holds it
    assert not a.is_leader()


async def test_resigning_deletes_the_key_and_the_other_takes_it_at_once(
    nc: Client, settings: Settings
) -> None:
    a = replica(nc, settings, "a", Clock(1000.0))
    b = replica(nc, settings, "b", Clock(1000.0))
    a.start()
    b.start()
    try:
        await eventually(lambda: a.is_leader() or b.is_leader(), "a leader", timeout_s=5)
        leader, other = (a, b) if a.is_leader() else (b, a)
        t0 = time.monotonic()
        await leader.stop()
        assert not leader.is_leader()
        # The watch sees the delete: no wait for a renewal period or the TTL.
        await eventually(other.is_leader, "the other to lead", timeout_s=3, interval_s=0.02)
        assert time.monotonic() - t0 < 1.0
        assert await key_value(nc, settings) == other.instance.encode()
    finally:
        await a.stop()
        await b.stop()
