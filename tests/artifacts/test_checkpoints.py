"""Checkpoints in the artifact-store: the rules as plain functions, and
`Deliveries` with the sweeper against a real nats-server, a fake recorder
(it keeps JobRecord.checkpoint as the recorder does) and the agent's own
delivery (`agent.delivery.deliver`)."""

from __future__ import annotations

import datetime as dt
import hashlib
import random
from pathlib import Path

import msgspec
import pytest
from nats.aio.client import Client

from lorafleet.artifacts import AsyncPublisher, ObjectInfo, record_from_info
from lorafleet.names import Names, chunk_msg_id, object_chunk_subject
from lorafleet_schemas.messages import (
    ArtifactKind,
    ArtifactStoredRequest,
    CheckpointRef,
    JobRecord,
    JobState,
)
from lorafleet_services.artifact_store.assembly import (
    ChunkError,
    Key,
    VerifiedArtifact,
    delivery_refusal_reason,
    is_committed_by,
    object_chunk_token,
    object_info,
    parse_chunk,
    report_owed,
    superseded,
)
from lorafleet_services.artifact_store.delivery import Deliveries
from lorafleet_services.artifact_store.streams import Streams
from lorafleet_services.artifact_store.sweeper import IDLE_CHECK_S, Sweeper
from tests.artifacts.conftest import (
    artifacts_stream_empty,
    chunks_of,
    deliver_file,
    download,
    object_chunks,
    publish,
)
from tests.artifacts.fakes import FakeClock, FakeRecorder, job

N = Names()
CKPT = ArtifactKind.CHECKPOINT
PEFT = ArtifactKind.PEFT
#: Bytes per chunk in these tests (so a checkpoint is several chunks).
CHUNK = 4096


def key(step: int, attempt: int = 1) -> Key:
    return Key("node-a", "job1", CKPT, attempt, step)


def running(**changes: object) -> JobRecord:
    """job1 on node-a, attempt 1, running; it expects peft and gguf only."""
    return job(**{"state": JobState.RUNNING, **changes})


def info_of(step: int, attempt: int = 1) -> ObjectInfo:
    return ObjectInfo(
        name="job1/checkpoint",
        nuid=object_chunk_token(key(step, attempt), "w"),
        metadata={"attempt": str(attempt), "step": str(step)},
    )


# --- the rules -------------------------------------------------------------------


def test_a_checkpoint_chunk_carries_its_step() -> None:
    j = running()
    [(headers, _)] = chunks_of(j, CKPT, b"x", CHUNK, checkpoint_step=7)
    subject = N.artifact_chunks("node-a", "job1", "checkpoint")
    assert parse_chunk(N, subject, headers).key == key(7)
    [(no_step, _)] = chunks_of(j, CKPT, b"x", CHUNK)
    with pytest.raises(ChunkError, match="lacks its step"):
        parse_chunk(N, subject, no_step)
    # The peft artifact's key is as before (no step).
    [(peft, _)] = chunks_of(j, PEFT, b"x", CHUNK)
    assert parse_chunk(N, N.artifact_chunks("node-a", "job1", "peft"), peft).key.step == 0
    # One attempt delivers many checkpoints: ids and object tokens differ by step.
    assert chunk_msg_id("job1", "checkpoint", 1, 0, 5) != chunk_msg_id(
        "job1", "checkpoint", 1, 0, 50
    )
    assert not is_committed_by(object_chunk_token(key(50), "w"), key(5))
    assert is_committed_by(object_chunk_token(key(5), "w"), key(5))


def test_a_checkpoint_is_taken_while_the_job_trains_whatever_it_expects() -> None:
    for state in (JobState.PREPARING, JobState.RUNNING, JobState.CONVERTING, JobState.UPLOADING):
        assert delivery_refusal_reason(running(state=state), key(3)) is None, state
    assert "no checkpoint yet" in (
        delivery_refusal_reason(running(state=JobState.STARTING), key(3)) or ""
    )
    for state in (JobState.FAILED, JobState.DONE, JobState.CANCELLED, JobState.QUEUED):
        assert delivery_refusal_reason(running(state=state), key(3)) is not None, state
    assert "node-b" in (delivery_refusal_reason(running(node="node-b"), key(3)) or "")
    assert "attempt 2" in (delivery_refusal_reason(running(attempt=2), key(3)) or "")
    # The other kinds still need the job to make them.
    assert "not peft" in (
        delivery_refusal_reason(running(artifacts_expected=[]), Key("node-a", "job1", PEFT, 1))
        or ""
    )


def test_only_a_newer_checkpoint_replaces_the_stored_one() -> None:
    assert superseded(None, key(1)) is None
    held = info_of(10)
    assert superseded(held, key(11)) is None
    assert "not newer than the stored one (step 10" in (superseded(held, key(10)) or "")
    assert superseded(held, key(9)) is not None
    # A later attempt resumed from it (or from older): its checkpoints win.
    assert superseded(held, key(3, attempt=2)) is None
    assert superseded(info_of(3, attempt=2), key(50, attempt=1)) is not None
    assert superseded(msgspec.structs.replace(held, deleted=True), key(1)) is None


def test_the_recorder_is_owed_a_checkpoint_until_it_holds_that_one() -> None:
    ref = CheckpointRef(
        job_id="job1", kind=CKPT, step=10, attempt=1, object="job1/checkpoint",
        size=1, sha256="0" * 64,
    )  # fmt: skip
    assert report_owed(running(), key(10))
    assert not report_owed(running(checkpoint=ref), key(10))
    assert report_owed(running(checkpoint=ref), key(20))
    # A checkpoint is not one of the artifacts that make the job done.
    assert report_owed(running(artifacts_stored=[CKPT]), key(10))


def test_a_stored_checkpoint_says_its_step_and_is_listed() -> None:
    whole = VerifiedArtifact(size=3, sha256="ab" * 32, count=1)
    now = dt.datetime.now(dt.UTC)
    info = object_info(
        N, key(40), whole, chunks=1, chunk_bytes=3, base_model="m", now=now, nuid="n"
    )
    assert info["name"] == "job1/checkpoint" and info["metadata"]["step"] == "40"
    record = record_from_info(msgspec.convert(info, ObjectInfo))
    assert record is not None and record.kind is CKPT and record.object == "job1/checkpoint"
    peft = object_info(
        N, Key("node-a", "job1", PEFT, 1), whole, chunks=1, chunk_bytes=3, base_model="m",
        now=now, nuid="n",
    )  # fmt: skip
    assert "step" not in peft["metadata"]


# --- against a real nats-server --------------------------------------------------------


def machine(
    nc: Client, publisher: AsyncPublisher, recorder: FakeRecorder
) -> tuple[Deliveries, Sweeper, FakeClock]:
    clock = FakeClock()
    deliveries = Deliveries(Streams(nc.jetstream(), N), publisher, recorder, clock)
    return deliveries, Sweeper(deliveries, recorder, clock, orphan_age_s=0), clock


async def deliver_checkpoint(
    nc: Client, tmp_path: Path, step: int, seed: int, size: int = 30_000
) -> bytes:
    """A checkpoint of `size` random bytes delivered as the agent delivers it."""
    data = random.Random(seed).randbytes(size)
    path = tmp_path / f"ck-{step}.tar"
    path.write_bytes(data)
    await deliver_file(nc, running(), CKPT, path, chunk_bytes=CHUNK, step=step)
    return data


def told(step: int, data: bytes) -> ArtifactStoredRequest:
    return ArtifactStoredRequest(
        id="job1", kind=CKPT, size=len(data), sha256=hashlib.sha256(data).hexdigest(),
        step=step, attempt=1, object="job1/checkpoint",
    )  # fmt: skip


def chunk_count(data: bytes) -> int:
    return -(-len(data) // CHUNK)


async def test_the_newest_replaces_the_stored_one_and_a_cut_one_changes_nothing(
    nc: Client, publisher: AsyncPublisher, tmp_path: Path
) -> None:
    recorder = FakeRecorder(running())
    deliveries, sweeper, clock = machine(nc, publisher, recorder)
    first = await deliver_checkpoint(nc, tmp_path, 10, seed=1)
    await deliveries.recover_all()
    assert recorder.reports == [told(10, first)]
    assert await download(nc, "job1", CKPT, tmp_path) == first
    second = await deliver_checkpoint(nc, tmp_path, 20, seed=2)
    await deliveries.recover_all()
    assert recorder.reports == [told(10, first), told(20, second)]
    assert await download(nc, "job1", CKPT, tmp_path) == second
    # Only the newest is kept: its chunks and its info, the first one's purged.
    assert await object_chunks(nc) == chunk_count(second) + 1
    assert await artifacts_stream_empty(nc)
    # Not one of the artifacts that finish the job.
    assert recorder.jobs["job1"].artifacts_stored == []
    assert recorder.jobs["job1"].state is JobState.RUNNING

    # A delivery cut mid-way (the node lost): the stored one stays, and recorded.
    cut = random.Random(3).randbytes(30_000)
    await publish(
        nc, running(), CKPT, chunks_of(running(), CKPT, cut, CHUNK, checkpoint_step=30)[:3]
    )
    await deliveries.recover_all()
    assert key(30) in deliveries.open
    assert await download(nc, "job1", CKPT, tmp_path) == second
    held = recorder.jobs["job1"].checkpoint
    assert held is not None and (held.step, held.sha256) == (20, told(20, second).sha256)
    # The job is failed as lost: the cut delivery is given up; the failed
    # job keeps its checkpoint through every sweep, for a resume.
    recorder.jobs["job1"] = running(state=JobState.FAILED, checkpoint=held)
    clock.now_s += IDLE_CHECK_S + 1
    await sweeper.tick()
    assert key(30) not in deliveries.open
    await sweeper.sweep()
    assert await object_chunks(nc) == chunk_count(second) + 1
    assert await download(nc, "job1", CKPT, tmp_path) == second
    assert await artifacts_stream_empty(nc)


async def test_an_older_or_corrupt_checkpoint_leaves_the_stored_one_and_the_job_alone(
    nc: Client, publisher: AsyncPublisher, tmp_path: Path
) -> None:
    recorder = FakeRecorder(running())
    deliveries, _, _ = machine(nc, publisher, recorder)
    newest = await deliver_checkpoint(nc, tmp_path, 20, seed=4)
    await deliveries.recover_all()
    older = await deliver_checkpoint(nc, tmp_path, 10, seed=5)  # a late copy
    await deliveries.recover_all()
    corrupt = random.Random(6).randbytes(20_000)
    msgs = chunks_of(running(), CKPT, corrupt, CHUNK, sha256="ab" * 32, checkpoint_step=30)
    await publish(nc, running(), CKPT, msgs)
    await deliveries.recover_all()
    assert recorder.reports == [told(20, newest)]
    assert older != newest and await download(nc, "job1", CKPT, tmp_path) == newest
    assert recorder.jobs["job1"].state is JobState.RUNNING, recorder.jobs["job1"].message
    assert await object_chunks(nc) == chunk_count(newest) + 1
    assert await artifacts_stream_empty(nc) and not deliveries.open


async def test_a_checkpoint_is_refused_before_the_job_is_on_its_node_and_after(
    nc: Client, publisher: AsyncPublisher, tmp_path: Path
) -> None:
    for step, state in ((5, JobState.STARTING), (6, JobState.DONE)):
        recorder = FakeRecorder(running(state=state))
        deliveries, _, _ = machine(nc, publisher, recorder)
        await deliver_checkpoint(nc, tmp_path, step, seed=7)
        await deliveries.recover_all()
        assert recorder.reports == [] and key(step) in deliveries.ended
        assert await object_chunks(nc) == 0 and await artifacts_stream_empty(nc)


async def test_a_recorder_that_does_not_know_checkpoints_does_not_hold_the_store(
    nc: Client, publisher: AsyncPublisher, tmp_path: Path
) -> None:
    recorder = FakeRecorder(running())
    recorder.refuse_checkpoints = True
    deliveries, _, _ = machine(nc, publisher, recorder)
    data = await deliver_checkpoint(nc, tmp_path, 5, seed=8)
    await deliveries.recover_all()
    # Stored, cleaned up and over: not retried for ever against a "bad request".
    assert key(5) in deliveries.ended and not deliveries.open
    assert await artifacts_stream_empty(nc)
    assert await download(nc, "job1", CKPT, tmp_path) == data
    committed = object_chunk_subject(N.artifacts_bucket, object_chunk_token(key(5), ""))
    assert committed.startswith(f"$O.{N.artifacts_bucket}.C.job1.checkpoint.1.5.")
