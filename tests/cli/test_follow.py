"""Following a job, without a bus: what the view prints above the display,
how often plain lines come, the exit codes and the summary."""

from __future__ import annotations

import datetime as dt

import msgspec

from lorafleet.exits import Exit
from lorafleet_schemas.messages import (
    ArtifactKind,
    ArtifactRecord,
    Engine,
    JobEvent,
    JobRecord,
    JobState,
    TrainerParams,
)
from lorafleet_services.cli.follow import (
    JobView,
    PlainPacer,
    exit_code,
    human_bytes,
    plain_line,
    summary_lines,
)

T0 = dt.datetime(2026, 1, 1, 12, 0, tzinfo=dt.UTC)


def record(**changes: object) -> JobRecord:
    job = JobRecord(
        id="j1", name="demo", model="tiny", engine=Engine.VLLM, node="gpu-1",
        gpu_memory_mib=100, dataset="d", dataset_sha256="s", records=10,
        params=TrainerParams(), state=JobState.RUNNING, message="", step=0, steps=300,
        loss=None, eval_loss=None, peak_mib=0, attempt=1, artifacts_expected=[],
        artifacts_stored=[], created_at=T0, updated_at=T0, started_at=T0,
    )  # fmt: skip
    return msgspec.structs.replace(job, **changes)


def at(seconds: float) -> dt.datetime:
    return T0 + dt.timedelta(seconds=seconds)


def test_state_changes_and_new_messages_print_above_progress_does_not() -> None:
    view = JobView(record(state=JobState.PREPARING))
    running = record(state=JobState.RUNNING, message="300 steps", updated_at=at(1))
    [line] = view.update(JobEvent(kind="state", job=running))
    assert "j1 running on gpu-1" in line and "300 steps" in line
    progress = record(message="300 steps", step=5, loss=2.0, updated_at=at(2))
    assert view.update(JobEvent(kind="progress", job=progress, tokens_per_s=900.0)) == []
    warned = record(message="low on memory", step=6, updated_at=at(3))
    assert [ln.split("  ", 1)[1] for ln in view.update(JobEvent(kind="progress", job=warned))] == [
        "low on memory"
    ]
    older = record(step=1, updated_at=at(0.5))
    assert view.update(JobEvent(kind="progress", job=older)) == [] and view.job.step == 6
    assert view.tokens_per_s == 900.0


def test_the_newer_version_wins_even_with_an_earlier_time() -> None:
    """Found in CI: a cancel stamped its time, then waited for the row while
    a status batch committed; the cancel's record was dropped as older and
    the watch never ended. The version orders them, the time does not."""
    view = JobView(record(step=5, updated_at=at(2), version=7))
    cancelled = record(state=JobState.CANCELLED, step=5, updated_at=at(1.9), version=8)
    [line] = view.update(JobEvent(kind="state", job=cancelled))
    assert "j1 cancelled" in line and view.job.state is JobState.CANCELLED
    late = record(step=9, updated_at=at(3), version=6)
    assert view.update(JobEvent(kind="progress", job=late)) == []
    assert view.job.state is JobState.CANCELLED


def test_the_eta_counts_down_between_events_and_the_line_says_it_all() -> None:
    view = JobView(record())
    job = record(step=150, loss=0.5, eval_loss=0.6, peak_mib=512, updated_at=at(1))
    view.update(JobEvent(kind="progress", job=job, tokens_per_s=1234.0, eta_s=90.0), now=100.0)
    assert view.eta_left_s(now=130.0) == 60.0
    line = plain_line(view, now=130.0)
    for part in ("running", "step 150/300 (50%)", "loss 0.5", "eval 0.6", "1,234 tok/s"):
        assert part in line
    assert "ETA 1:00" in line and "peak 512 MiB" in line


def test_plain_lines_come_per_tenth_of_the_steps_or_per_period_never_per_step() -> None:
    pacer = PlainPacer(every_s=30.0, last_at=0.0)
    due = [s for s in range(1, 301) if pacer.due(record(step=s), now=s * 0.01)]
    assert due == list(range(30, 301, 30))
    slow = PlainPacer(every_s=30.0, last_at=0.0)
    # Ten minutes a step: a line per step is then one per 30 s at most.
    assert [s for s in range(1, 6) if slow.due(record(step=s, steps=10_000), now=s * 600.0)] == [
        1, 2, 3, 4, 5
    ]  # fmt: skip
    assert not slow.due(record(step=5, steps=10_000), now=10_000.0)  # no new step, no line


def test_exit_codes_scripts_rely_on() -> None:
    assert exit_code(record(state=JobState.DONE)) == Exit.OK == 0
    assert exit_code(record(state=JobState.FAILED)) == Exit.JOB_FAILED
    assert exit_code(record(state=JobState.CANCELLED)) == Exit.JOB_CANCELLED


def test_the_summary_has_final_and_best_eval_loss_duration_and_artifacts() -> None:
    view = JobView(record())
    for step, eval_loss in ((100, 0.9), (200, 0.7), (300, 0.8)):
        job = record(step=step, eval_loss=eval_loss, loss=0.5, updated_at=at(step))
        view.update(JobEvent(kind="progress", job=job))
    done = record(
        state=JobState.DONE, step=300, loss=0.5, eval_loss=0.8, updated_at=at(400),
        finished_at=at(3725), message="stored",
    )  # fmt: skip
    view.update(JobEvent(kind="state", job=done))
    peft = ArtifactRecord(
        job_id="j1", kind=ArtifactKind.PEFT, node="gpu-1", object="o", size=3 * 1024 * 1024,
        sha256="ab" * 32, base_model="tiny", stored_at=at(3725),
    )  # fmt: skip
    text = "\n".join(summary_lines(view, [peft]))
    assert "job j1 done: stored" in text
    assert "final eval loss 0.8" in text and "best eval loss 0.7" in text
    assert "took 1:02:05" in text and "peft: 3.0 MiB" in text
    assert "lorafleet download j1" in text
    assert human_bytes(512) == "512 B"


def test_a_requeue_is_a_state_change_line_and_the_watch_goes_on() -> None:
    view = JobView(record(step=47, updated_at=at(1)))
    said = "node gpu-1 was lost at step 47; attempt 2 of 3 resumes from the checkpoint at step 40"
    back = record(state=JobState.QUEUED, node=None, step=47, message=said, updated_at=at(2))
    [line] = view.update(JobEvent(kind="state", job=back))
    assert "j1 queued at step 47/300" in line and said in line
    assert exit_code(view.job) == Exit.UNREACHABLE  # not final: a cut watch is no success
    again = record(state=JobState.STARTING, node="gpu-2", attempt=2, step=47, updated_at=at(3))
    [line] = view.update(JobEvent(kind="state", job=again))
    assert "j1 starting on gpu-2" in line
