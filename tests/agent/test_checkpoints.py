"""Checkpoints, resume and retryable failures through a real agent process and
a real trainer process (tests/agent/checkpointing_trainer.py), over NATS."""

from __future__ import annotations

import datetime as dt
import hashlib
import io
import itertools
import json
import re
import tarfile
from dataclasses import dataclass
from pathlib import Path

import msgspec
import nats.errors

from lorafleet.names import Header, artifact_object_name
from lorafleet_schemas.messages import (
    ArtifactChunkHeader,
    ArtifactKind,
    CheckpointRef,
    JobState,
    StatusReport,
)
from lorafleet_services.agent.transfer.packing import pack_adapter, pack_checkpoint
from tests.agent.conftest import Bus, Reports, finished, start_request
from tests.eventually import eventually

TRAINER = str(Path(__file__).with_name("checkpointing_trainer.py"))
CHECKPOINT = ArtifactKind.CHECKPOINT
_RESUME_RE = re.compile(r"^resume=(.*) files=(.*)$")


@dataclass
class Delivery:
    """One checkpoint's chunks as the artifacts stream holds them."""

    step: int
    bodies: dict[int, bytes]
    times: list[dt.datetime]
    last: ArtifactChunkHeader | None = None

    @property
    def data(self) -> bytes:
        return b"".join(self.bodies[i] for i in sorted(self.bodies))


async def checkpoint_deliveries(fleet: Bus, node: str, job_id: str) -> dict[int, Delivery]:
    """Every checkpoint chunk of the job in the artifacts stream, by step."""
    subject = fleet.settings.names.artifact_chunks(node, job_id, CHECKPOINT.value)
    sub = await fleet.js.subscribe(subject, ordered_consumer=True)
    out: dict[int, Delivery] = {}
    try:
        while True:
            try:
                msg = await sub.next_msg(timeout=2)
            except nats.errors.TimeoutError:
                break
            assert msg.headers is not None
            h = msgspec.json.decode(msg.headers[Header.CHUNK], type=ArtifactChunkHeader)
            assert h.step is not None and h.kind is CHECKPOINT
            assert msg.headers[Header.MSG_ID] == f"{job_id}.checkpoint.1.{h.step}.{h.seq}"
            d = out.setdefault(h.step, Delivery(h.step, {}, []))
            d.bodies[h.seq] = msg.data
            d.times.append(msg.metadata.timestamp)
            if h.last:
                d.last = h
            if msg.metadata.num_pending == 0:
                break
    finally:
        await sub.unsubscribe()
    return out


def tar_files(data: bytes) -> dict[str, bytes]:
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:*") as tar:
        return {
            m.name: tar.extractfile(m).read()  # type: ignore[union-attr]
            for m in tar.getmembers()
            if m.isfile()
        }


def step_times(reports: Reports) -> list[tuple[int, dt.datetime]]:
    return [(r.step or 0, r.time) for r in reports.items if r.loss is not None]


async def test_checkpoints_are_delivered_while_the_trainer_keeps_stepping(fleet: Bus) -> None:
    # 1 MiB checkpoints every 5 steps of 10 ms, sent in 1 KiB chunks: each
    # delivery takes several steps' time, so offers pile up behind it.
    ckpt_bytes = 1 << 20
    env = {
        "LORAFLEET_STANDIN_TEST_STEPS": "150",
        "LORAFLEET_STANDIN_TEST_EVERY": "5",
        "LORAFLEET_STANDIN_TEST_CKPT_BYTES": str(ckpt_bytes),
    }
    agent = await fleet.agent(env=env, trainer=TRAINER, chunk_bytes=1024)
    name, sha = await fleet.upload()
    reports = await fleet.reports("node-1", "job-ck")
    assert (await fleet.start(start_request("job-ck", name, sha))).accepted
    await reports.until(lambda r: r.message.startswith("delivered"), what="delivered")
    await finished(agent, "job-ck")

    deliveries = await checkpoint_deliveries(fleet, "node-1", "job-ck")
    whole = sorted(s for s, d in deliveries.items() if d.last is not None)
    assert len(whole) >= 2, f"whole checkpoint deliveries: {whole}"
    for step in whole:
        d = deliveries[step]
        assert d.last is not None and d.last.count == len(d.bodies)
        assert d.last.sha256 == hashlib.sha256(d.data).hexdigest()
        files = tar_files(d.data)
        assert json.loads(files["trainer_state.json"]) == {"step": step}
        assert len(files["state.bin"]) == ckpt_bytes
    # One in flight at a time, newest next: offered ones were skipped, never reordered.
    started = sorted(deliveries, key=lambda s: min(deliveries[s].times))
    assert started == sorted(deliveries)
    assert len(deliveries) < 30, "every offer was sent: none waited in the slot"

    # The trainer's lines were read on while each checkpoint went out.
    steps = step_times(reports)
    assert [s for s, _ in steps] == list(range(1, 151))
    # Of those with steps after them (the last one's delivery may run past the
    # trainer's end, when no step is left to report: a CI run picked step 150).
    later = [s for s in whole if s <= 150 - 3]
    assert later, f"no whole delivery before the last steps: {whole}"
    longest = max((deliveries[s] for s in later), key=lambda d: max(d.times) - min(d.times))
    during = [s for s, t in steps if min(longest.times) < t < max(longest.times)]
    assert len(during) >= 3, f"steps reported while step {longest.step} was delivered: {during}"
    gaps_s = [(b - a).total_seconds() for (_, a), (_, b) in itertools.pairwise(steps)]
    assert max(gaps_s) < 1.0, f"a {max(gaps_s):.2f} s gap between step reports"
    # Superseded checkpoint directories were removed as the trainer went on
    # (in flight, waiting, just written; the trainer may be a line or two
    # ahead of the agent): never all 30.
    dirs = [int(r.message[5:]) for r in reports.items if r.message.startswith("dirs=")]
    assert len(dirs) == 30 and max(dirs) <= 6, dirs


def resume_seen(reports: Reports) -> tuple[dict[str, str] | None, list[str]]:
    """What the trainer said job.json's `resume` was, and the files it found there."""
    for r in reports.items:
        m = _RESUME_RE.match(r.message)
        if m:
            return json.loads(m.group(1)), json.loads(m.group(2))
    raise AssertionError(f"the trainer never said what it resumes from: {reports.summary()}")


async def stored(fleet: Bus, name: str, data: bytes, kind: ArtifactKind) -> CheckpointRef:
    """`data` put into the artifacts bucket as `name`; its reference."""
    obs = await fleet.js.object_store(fleet.settings.names.artifacts_bucket)
    await obs.put(name, data)
    return CheckpointRef(
        job_id=name.split("/")[0],
        kind=kind,
        step=40 if kind is CHECKPOINT else 0,
        object=name,
        size=len(data),
        sha256=hashlib.sha256(data).hexdigest(),
    )


async def run_to_end(
    fleet: Bus, job_id: str, attempt: int = 1, resume: CheckpointRef | None = None
) -> tuple[Reports, StatusReport]:
    name, sha = await fleet.upload()
    reports = await fleet.reports("node-1", job_id)
    req = start_request(job_id, name, sha, attempt=attempt, resume=resume)
    assert (await fleet.start(req)).accepted
    last = await reports.until(
        lambda r: r.message.startswith("delivered") or r.state is JobState.FAILED,
        what="the end",
    )
    return reports, last


async def test_a_resumed_start_gets_the_checked_unpacked_checkpoint(
    fleet: Bus, tmp_path: Path
) -> None:
    agent = await fleet.agent(trainer=TRAINER)
    src = tmp_path / "ck"
    (src / "sub").mkdir(parents=True)
    (src / "adapter_model.safetensors").write_bytes(b"w" * 5000)
    (src / "sub" / "rng.pt").write_bytes(b"r" * 100)
    ck = pack_checkpoint(src, tmp_path / "ck.tar").read_bytes()
    ref = await stored(fleet, artifact_object_name("job-r", "checkpoint"), ck, CHECKPOINT)

    # Its own checkpoint, on a later attempt: continue.
    reports, last = await run_to_end(fleet, "job-r", attempt=2, resume=ref)
    assert last.state is not JobState.FAILED, last.message
    resume, files = resume_seen(reports)
    job_dir = fleet.tmp_path / "agent-node-1" / "jobs" / "job-r"
    assert resume == {"dir": str(job_dir / "resume"), "mode": "continue"}
    assert files == ["adapter_model.safetensors", "sub/rng.pt"]
    assert any(
        "fetching the checkpoint at step 40 of job job-r" in r.message for r in reports.items
    )
    await finished(agent, "job-r")

    # Another job's checkpoint, and another job's adapter: weights only.
    reports, _ = await run_to_end(fleet, "job-w", resume=ref)
    assert resume_seen(reports)[0]["mode"] == "weights"  # type: ignore[index]
    await finished(agent, "job-w")
    peft = pack_adapter(src, tmp_path / "a.tar.gz").read_bytes()
    ref_peft = await stored(fleet, artifact_object_name("job-p", "peft"), peft, ArtifactKind.PEFT)
    reports, _ = await run_to_end(fleet, "job-w2", resume=ref_peft)
    resume, files = resume_seen(reports)
    assert resume is not None and resume["mode"] == "weights" and "sub/rng.pt" in files
    await finished(agent, "job-w2")


async def test_a_resume_that_does_not_match_fails_clearly_before_training(
    fleet: Bus, tmp_path: Path
) -> None:
    agent = await fleet.agent(trainer=TRAINER)
    src = tmp_path / "ck"
    src.mkdir()
    (src / "a.bin").write_bytes(b"a" * 1000)
    ck = pack_checkpoint(src, tmp_path / "ck.tar").read_bytes()
    ref = await stored(fleet, artifact_object_name("job-m", "checkpoint"), ck, CHECKPOINT)

    # Other bytes than the reference says.
    other = hashlib.sha256(b"another checkpoint").hexdigest()
    bad = msgspec.structs.replace(ref, sha256=other)
    reports, last = await run_to_end(fleet, "job-m", attempt=2, resume=bad)
    assert last.state is JobState.FAILED and not last.retryable
    assert "sha256" in last.message and other in last.message and ref.sha256 in last.message
    assert "checkpoint at step 40 of job job-m" in last.message
    assert not any(r.state is JobState.RUNNING for r in reports.items), "the trainer ran"
    await finished(agent, "job-m")

    # No such object.
    gone = msgspec.structs.replace(ref, object="job-gone/checkpoint")
    _, last = await run_to_end(fleet, "job-gone", attempt=2, resume=gone)
    assert last.state is JobState.FAILED and not last.retryable
    assert "not in the object store" in last.message and "job-gone/checkpoint" in last.message
    await finished(agent, "job-gone")

    # An archive reaching outside its directory is refused, nothing written outside.
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        member = tarfile.TarInfo("../../escaped.txt")
        member.size = 4
        tar.addfile(member, io.BytesIO(b"evil"))
    evil = await stored(fleet, "job-e/checkpoint", buf.getvalue(), CHECKPOINT)
    _, last = await run_to_end(fleet, "job-e", attempt=2, resume=evil)
    assert last.state is JobState.FAILED and "unpacking" in last.message, last.message
    await finished(agent, "job-e")
    assert not list(fleet.tmp_path.rglob("escaped.txt"))
    assert len(agent.events("trainer.started")) == 0


async def test_only_failures_not_the_jobs_own_are_retryable(fleet: Bus) -> None:
    agent = await fleet.agent(trainer=TRAINER)

    # Exit 3: the environment's failure (a CUDA error), not the job's.
    reports, last = await run_to_end(fleet, "job-exit3")
    assert last.state is JobState.FAILED and last.retryable, last.message
    assert "illegal memory access" in last.message and "not the job's own" in last.message
    await finished(agent, "job-exit3")
    # A re-sent start of that attempt is refused, saying how it ended; the
    # next attempt of the same job is taken.
    name, sha = await fleet.upload()
    again = await fleet.start(start_request("job-exit3", name, sha))
    assert not again.accepted
    assert "already ran attempt 1 of job job-exit3" in again.reason and "failed" in again.reason
    assert (await fleet.start(start_request("job-exit3", name, sha, attempt=2))).accepted
    await eventually(
        lambda: [e["attempt"] for e in agent.events("trainer.started")],
        "attempt 2 to start its trainer",
        until=lambda attempts: attempts == [1, 2],
    )
    await reports.until(lambda r: r.attempt == 2 and r.state is JobState.FAILED, what="2 failed")
    await eventually(
        lambda: len([e for e in agent.events("job.finished") if e["job_id"] == "job-exit3"]),
        "attempt 2 to finish",
        until=lambda n: n == 2,
    )

    # Killed by a signal the agent did not send (the OOM killer's SIGKILL).
    _, last = await run_to_end(fleet, "job-kill2")
    assert last.state is JobState.FAILED and last.retryable, last.message
    assert "SIGKILL, which the agent did not send" in last.message
    await finished(agent, "job-kill2")

    # The job's own failure (exit 1) and bad input (exit 2) are not retryable.
    for job_id in ("job-exit1", "job-exit2"):
        _, last = await run_to_end(fleet, job_id)
        assert last.state is JobState.FAILED and not last.retryable, last.message
        assert "not the job's own" not in last.message
        await finished(agent, job_id)

    # An agent stopping mid-job: the job's failure is not its own.
    await agent.stop()
    agent = await fleet.agent(trainer=TRAINER, env={"LORAFLEET_STANDIN_TEST_STEPS": "100000"})
    reports = await fleet.reports("node-1", "job-long")
    assert (await fleet.start(start_request("job-long", name, sha))).accepted
    await reports.until_state(JobState.RUNNING)
    await agent.stop()
    last = await reports.until_state(JobState.FAILED)
    assert last.retryable and "stopped while running" in last.message


def test_checkpoint_bookkeeping_leaves_directories_outside_alone(tmp_path: Path) -> None:
    from lorafleet_services.agent.transfer.checkpoints import inside

    root = tmp_path / "checkpoints"
    (root / "step-00000001").mkdir(parents=True)
    (tmp_path / "elsewhere").mkdir()
    (root / "link").symlink_to(tmp_path / "elsewhere")
    assert inside(root, str(root / "step-00000001")) == (root / "step-00000001").resolve()
    assert inside(root, str(root / "link")) is None
    assert inside(root, str(tmp_path / "elsewhere")) is None
    assert inside(root, str(root / ".." / "elsewhere")) is None
    assert inside(root, str(root / "missing")) is None
    assert inside(root, "/") is None
