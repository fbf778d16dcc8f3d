"""The sweeper: its rules as plain functions, and `Sweeper` against a real
nats-server with a fake recorder and a clock the test moves."""

from __future__ import annotations

import datetime as dt

import pytest
from nats.aio.client import Client

from lorafleet.artifacts import AsyncPublisher, ObjectInfo
from lorafleet.names import Names, object_chunk_subject
from lorafleet.settings import Settings
from lorafleet_schemas.messages import ArtifactKind, JobState
from lorafleet_services.artifact_store import sweeper as sweeper_module
from lorafleet_services.artifact_store.assembly import Key
from lorafleet_services.artifact_store.delivery import Deliveries
from lorafleet_services.artifact_store.streams import Streams
from lorafleet_services.artifact_store.sweeper import (
    IDLE_CHECK_S,
    SWEEP_EVERY_S,
    Sweeper,
    age_s,
    committed_chunks,
    orphans,
    sweep_due,
)
from tests.artifacts.conftest import artifacts_stream_empty, chunks_of, object_chunks, publish
from tests.artifacts.fakes import FakeClock, FakeRecorder, job

N = Names()
PEFT = ArtifactKind.PEFT
KEY = Key("node-a", "job1", PEFT, 1)

# --- the rules -------------------------------------------------------------------


def test_orphans_are_old_chunks_nobody_refers_to_or_writes() -> None:
    ages = {"c.committed": 900.0, "c.writing": 900.0, "c.dead": 900.0, "c.young": 5.0}
    assert orphans(ages, {"c.committed"}, {"c.writing"}, min_age_s=600) == ["c.dead"]
    assert orphans(ages, {"c.committed"}, {"c.writing"}, min_age_s=0) == ["c.dead", "c.young"]


def test_committed_chunks_are_those_of_live_objects() -> None:
    live = ObjectInfo(name="job1/peft", nuid="job1.peft.1.w1")
    gone = ObjectInfo(name="job2/peft", nuid="job2.peft.1.w1", deleted=True)
    assert committed_chunks(N, [live, gone, None]) == {
        object_chunk_subject(N.artifacts_bucket, "job1.peft.1.w1")
    }


def test_age_and_when_a_sweep_is_due() -> None:
    now = dt.datetime(2026, 1, 1, 12, 0, 10, tzinfo=dt.UTC)
    assert age_s(now, now - dt.timedelta(seconds=10)) == 10.0
    assert age_s(now, None) == 0.0
    assert not sweep_due(1000.0 + SWEEP_EVERY_S, 1000.0)
    assert sweep_due(1000.0 + SWEEP_EVERY_S + 1, 1000.0)


# --- against a real nats-server --------------------------------------------------------


def sweeper_for(
    nc: Client,
    publisher: AsyncPublisher,
    recorder: FakeRecorder,
    *,
    orphan_age_s: float = Settings().artifact_orphan_age_s,
    idle_check_s: float = IDLE_CHECK_S,
) -> tuple[Sweeper, Deliveries, FakeClock]:
    clock = FakeClock()
    deliveries = Deliveries(Streams(nc.jetstream(), N), publisher, recorder, clock)
    sweeper = Sweeper(
        deliveries, recorder, clock, orphan_age_s=orphan_age_s, idle_check_s=idle_check_s
    )
    return sweeper, deliveries, clock


async def test_a_sweep_purges_a_dead_stores_chunks_and_nothing_else(
    nc: Client, publisher: AsyncPublisher
) -> None:
    recorder = FakeRecorder(job(), job(id="job2"))
    # A committed object (job2), and an open delivery of job1 (four chunks written).
    committed = chunks_of(job(id="job2"), PEFT, b"c" * 3000, 1000)
    await publish(nc, job(id="job2"), PEFT, committed)
    await publish(nc, job(), PEFT, chunks_of(job(), PEFT, b"w" * 10_000, 1000)[:4])
    sweeper, deliveries, _ = sweeper_for(nc, publisher, recorder, orphan_age_s=0)
    await deliveries.recover_all()
    assert KEY in deliveries.open
    dead = object_chunk_subject(N.artifacts_bucket, "job3.peft.1.deadbeef")
    for _ in range(2):
        await nc.jetstream().publish(dead, b"left behind")
    before = await object_chunks(nc)
    patient, _, _ = sweeper_for(nc, publisher, recorder)  # the default age (600 s)
    await patient.sweep()
    assert await object_chunks(nc) == before
    await sweeper.sweep()
    assert await object_chunks(nc) == before - 2
    assert deliveries.open[KEY].writer.chunks_written == 4


async def test_a_store_whose_clock_is_ahead_takes_no_young_chunk(
    nc: Client, publisher: AsyncPublisher, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A replica's delivery in progress (not in this store's `writing`) is
    a minute old on the server's clock, an hour and a minute on this host's
    (stepped, or skewed from the server's): it is kept. Before, its age
    was this host's clock minus the server's stamp."""
    recorder = FakeRecorder(job())
    theirs = object_chunk_subject(N.artifacts_bucket, "job1.peft.1.replica")
    await nc.jetstream().publish(theirs, b"a replica's chunk")
    ahead = dt.datetime.now(dt.UTC) + dt.timedelta(hours=1)
    monkeypatch.setattr(sweeper_module, "wall_now", lambda: ahead)
    sweeper, _, _ = sweeper_for(nc, publisher, recorder)  # the default age (600 s)
    await sweeper.sweep()
    assert await object_chunks(nc) == 1


async def test_an_idle_delivery_is_kept_while_its_job_takes_it_and_given_up_after(
    nc: Client, publisher: AsyncPublisher
) -> None:
    recorder = FakeRecorder(job())
    await publish(nc, job(), PEFT, chunks_of(job(), PEFT, b"w" * 10_000, 1000)[:4])
    sweeper, deliveries, clock = sweeper_for(nc, publisher, recorder)
    await deliveries.recover_all()
    clock.now_s += IDLE_CHECK_S + 1
    await sweeper.tick()
    assert KEY in deliveries.open  # still uploading: the agent may be slow
    recorder.jobs["job1"] = job(state=JobState.FAILED)
    await sweeper.tick()
    assert KEY in deliveries.open  # checked a moment ago
    clock.now_s += IDLE_CHECK_S + 1
    await sweeper.tick()
    assert KEY not in deliveries.open and KEY in deliveries.ended
    assert await object_chunks(nc) == 0
    assert await artifacts_stream_empty(nc)


async def test_an_idle_delivery_a_replica_committed_is_given_up(
    nc: Client, publisher: AsyncPublisher
) -> None:
    recorder = FakeRecorder(job())
    msgs = chunks_of(job(), PEFT, b"r" * 10_000, 1000)
    await publish(nc, job(), PEFT, msgs[:4])
    sweeper, mine, clock = sweeper_for(nc, publisher, recorder, idle_check_s=5.0)
    await mine.recover_all()
    await publish(nc, job(), PEFT, msgs[4:])
    replica = Deliveries(Streams(nc.jetstream(), N), publisher, recorder, FakeClock())
    await replica.recover_all()  # reads the whole delivery back and commits it
    assert recorder.jobs["job1"].artifacts_stored == [PEFT]
    clock.now_s += 6.0
    await sweeper.check_idle()
    assert KEY not in mine.open
    # Only the replica's object is left.
    assert await object_chunks(nc) == len(msgs) + 1
