"""Attempts in the store, on PostgreSQL and SQLite: the requeue edge, retryable
failures, checkpoints, the effective curve, and resume by hand."""

from __future__ import annotations

import pytest

from lorafleet.states import IllegalTransitionError
from lorafleet_schemas.messages import ArtifactKind, JobRecord, JobSpec, JobState
from lorafleet_services.recorder import fold, job_writes, store
from lorafleet_services.recorder.db import Sessions
from tests.recorder.test_store import SHA, rep

CP_SHA = "c" * 64


async def new_job(
    sm: Sessions, max_attempts: int = 3, node: str | None = None, model: str = "tiny-vllm"
) -> JobRecord:
    m = await store.get_model(sm, model)
    assert m is not None
    spec = JobSpec(model=model, gpu_memory_mib=1000, node=node, data="x", max_attempts=max_attempts)
    return await store.create_job(sm, spec, m, f"sha256/{SHA}", SHA, 3)


async def running_at(sm: Sessions, job: JobRecord, node: str, steps: range) -> JobRecord:
    """Send `job` to `node` and report it running through `steps` (loss 10 - step/10)."""
    applied, job = await store.transition(sm, job.id, JobState.QUEUED, JobState.STARTING, node=node)
    assert applied
    reports = [rep(job, 1, node=node, state=JobState.RUNNING)]
    reports += [
        rep(job, 2 + i, node=node, step=s, steps=100, loss=10 - s / 10, eval_loss=20 - s / 10)
        for i, s in enumerate(steps)
    ]
    await job_writes.apply_status(sm, reports)
    found = await store.get_job(sm, job.id)
    assert found is not None
    return found


async def checkpoint(sm: Sessions, job: JobRecord, step: int, attempt: int) -> JobRecord:
    got, _ = await job_writes.record_artifact(
        sm, job.id, ArtifactKind.CHECKPOINT, 1000 + step, CP_SHA,
        step=step, attempt=attempt, object_name=f"{job.id}/checkpoint",
    )  # fmt: skip
    return got


async def events(sm: Sessions, job_id: str) -> list[tuple[str | None, str, str]]:
    curve = await store.curve(sm, job_id)
    return [
        (e.from_state and e.from_state.value, e.to_state.value, e.message) for e in curve.events
    ]


async def test_a_requeue_goes_back_to_the_named_node_and_keeps_the_progress(
    models: Sessions,
) -> None:
    for named in (None, "n1"):
        job = await running_at(models, await new_job(models, node=named), "n1", range(1, 31))
        applied, back = await store.transition(
            models, job.id, JobState.RUNNING, JobState.QUEUED, "node n1 was lost"
        )
        assert applied and back.state is JobState.QUEUED and back.node == named
        assert back.step == 30 and back.loss == pytest.approx(7.0) and back.attempt == 1
        assert (await events(models, job.id))[-1] == ("running", "queued", "node n1 was lost")
        # A late report of the lost attempt changes nothing.
        late = await job_writes.apply_status(models, [rep(job, 99, node="n1", step=31, loss=1.0)])
        assert late.refused and (await store.get_job(models, job.id)) == back
        # A placed job goes anywhere; one named for a node waits for it.
        target = named or "n2"
        if named is not None:
            applied, _ = await store.transition(
                models, job.id, JobState.QUEUED, JobState.STARTING, node="n2"
            )
            assert not applied
        applied, again = await store.transition(
            models, job.id, JobState.QUEUED, JobState.STARTING, node=target
        )
        assert applied and again.attempt == 2 and again.node == target


async def test_no_requeue_without_attempts_left_and_a_cancel_wins(models: Sessions) -> None:
    job = await running_at(models, await new_job(models, max_attempts=1), "n1", range(1, 3))
    with pytest.raises(IllegalTransitionError, match="attempt 1 of 1"):
        await store.transition(models, job.id, JobState.RUNNING, JobState.QUEUED)
    assert (await store.get_job(models, job.id)) == job
    job = await running_at(models, await new_job(models), "n1", range(1, 3))
    applied, _ = await store.transition(models, job.id, JobState.RUNNING, JobState.CANCELLED)
    assert applied
    # The requeue that raced the cancel loses.
    applied, after = await store.transition(models, job.id, JobState.RUNNING, JobState.QUEUED)
    assert not applied and after.state is JobState.CANCELLED
    # A requeued job can be cancelled.
    job = await running_at(models, await new_job(models), "n1", range(1, 3))
    await store.transition(models, job.id, JobState.RUNNING, JobState.QUEUED)
    applied, after = await store.transition(models, job.id, JobState.QUEUED, JobState.CANCELLED)
    assert applied and after.state is JobState.CANCELLED


async def test_a_move_requeues_without_attempts_left_and_uses_none(models: Sessions) -> None:
    """A drain's move_training: the operator's requeue, not a loss."""
    job = await running_at(models, await new_job(models, max_attempts=1), "n1", range(1, 3))
    said = "node n1 was drained with move_training at step 2"
    applied, back = await store.transition(
        models, job.id, JobState.RUNNING, JobState.QUEUED, said, moved=True
    )
    assert applied and back.state is JobState.QUEUED and back.node is None
    assert back.attempt == 1 and back.max_attempts == 2
    assert (await events(models, job.id))[-1] == ("running", "queued", said)
    applied, again = await store.transition(
        models, job.id, JobState.QUEUED, JobState.STARTING, node="n2"
    )
    assert applied and again.attempt == 2 and again.max_attempts == 2
    # A move races a cancel as a requeue does: the cancel wins.
    applied, _ = await store.transition(models, job.id, JobState.STARTING, JobState.CANCELLED)
    assert applied
    applied, after = await store.transition(
        models, job.id, JobState.STARTING, JobState.QUEUED, moved=True
    )
    assert not applied and after.state is JobState.CANCELLED and after.max_attempts == 2


async def test_a_retryable_failure_requeues_with_attempts_left_else_fails(
    models: Sessions,
) -> None:
    job = await running_at(models, await new_job(models, max_attempts=2), "n1", range(1, 11))
    await checkpoint(models, job, 8, 1)
    why = "the trainer died of signal 9"
    await job_writes.apply_status(
        models, [rep(job, 50, node="n1", state=JobState.FAILED, message=why, retryable=True)]
    )
    back = await store.get_job(models, job.id)
    assert back is not None and back.state is JobState.QUEUED and back.node is None
    assert back.message == (
        f"the job failed on node n1 for a cause not its own ({why}) at step 10; "
        "attempt 2 of 2 resumes from the checkpoint at step 8"
    )
    job = await running_at(models, back, "n2", range(9, 12))
    assert job.attempt == 2
    await job_writes.apply_status(
        models, [rep(job, 50, node="n2", state=JobState.FAILED, message=why, retryable=True)]
    )
    ended = await store.get_job(models, job.id)
    assert ended is not None and ended.state is JobState.FAILED and ended.message == why
    # Not retryable: fails at once, attempts or not.
    job = await running_at(models, await new_job(models), "n1", range(1, 3))
    await job_writes.apply_status(
        models, [rep(job, 50, node="n1", state=JobState.FAILED, message="loss diverged")]
    )
    ended = await store.get_job(models, job.id)
    assert ended is not None and ended.state is JobState.FAILED


async def test_the_newest_checkpoint_of_the_current_attempt_is_kept_and_gates_nothing(
    models: Sessions,
) -> None:
    job = await running_at(models, await new_job(models), "n1", range(1, 21))
    got = await checkpoint(models, job, 10, 1)
    assert got.checkpoint is not None and got.checkpoint.step == 10
    assert got.checkpoint.object == f"{job.id}/checkpoint" and got.checkpoint.size == 1010
    assert got.artifacts_stored == [] and got.state is JobState.RUNNING
    assert (await checkpoint(models, job, 5, 1)).checkpoint == got.checkpoint  # older step
    await store.transition(models, job.id, JobState.RUNNING, JobState.QUEUED)
    # Delivered late, the lost attempt's newer checkpoint is still its newest.
    assert (await checkpoint(models, job, 15, 1)).checkpoint.step == 15  # type: ignore[union-attr]
    job = await running_at(models, await _get(models, job.id), "n2", range(16, 18))
    assert (await checkpoint(models, job, 20, 1)).checkpoint.step == 15  # type: ignore[union-attr]
    second = (await checkpoint(models, job, 17, 2)).checkpoint
    assert second is not None and (second.attempt, second.step) == (2, 17)
    with pytest.raises(store.CheckpointFieldsError):
        await job_writes.record_artifact(models, job.id, ArtifactKind.CHECKPOINT, 1, CP_SHA)
    # The adapter is what done waits for, and its ref is kept for resume_from.
    await job_writes.apply_status(models, [rep(job, 90, node="n2", state=JobState.UPLOADING)])
    done, _ = await job_writes.record_artifact(models, job.id, ArtifactKind.PEFT, 77, SHA)
    assert done.state is JobState.DONE and done.adapter is not None
    assert (done.adapter.object, done.adapter.size, done.adapter.kind) == (
        f"{job.id}/peft",
        77,
        ArtifactKind.PEFT,
    )


async def _get(sm: Sessions, job_id: str) -> JobRecord:
    job = await store.get_job(sm, job_id)
    assert job is not None
    return job


async def test_the_curve_is_the_effective_one_and_the_events_show_the_attempts(
    models: Sessions,
) -> None:
    job = await running_at(models, await new_job(models), "n1", range(1, 21))
    await checkpoint(models, job, 12, 1)
    await store.transition(models, job.id, JobState.RUNNING, JobState.QUEUED, "lost")
    job = await running_at(models, await _get(models, job.id), "n2", range(13, 16))
    curve = await store.curve(models, job.id)
    assert [(p.step, p.attempt) for p in curve.points] == [
        *((s, 1) for s in range(1, 13)),
        *((s, 2) for s in range(13, 16)),
    ]
    assert [(p.step, p.attempt) for p in curve.evals] == [(p.step, p.attempt) for p in curve.points]
    assert curve.points[12].loss == pytest.approx(10 - 1.3)
    moves = [(f, t) for f, t, _ in await events(models, job.id)]
    assert moves == [
        (None, "queued"), ("queued", "starting"), ("starting", "running"),
        ("running", "queued"), ("queued", "starting"), ("starting", "running"),
    ]  # fmt: skip
    # A later attempt that started afresh supersedes every earlier point,
    # even before its own first one.
    assert fold.effective(curve.points, {1: 0, 2: 12, 3: 0}) == []
    fresh = fold.effective(curve.points, {1: 0, 2: 0})
    assert [p.attempt for p in fresh] == [2, 2, 2]


async def test_resume_refuses_an_unknown_a_running_and_a_checkpointless_job(
    models: Sessions,
) -> None:
    with pytest.raises(store.NoSuchJobError):
        await job_writes.resume_job(models, "nope", 1)
    job = await running_at(models, await new_job(models, max_attempts=1), "n1", range(1, 5))
    await checkpoint(models, job, 3, 1)
    before = (await _get(models, job.id), await events(models, job.id))
    with pytest.raises(store.NotResumableError, match="is running: only a failed or cancelled"):
        await job_writes.resume_job(models, job.id, 1)
    assert (await _get(models, job.id), await events(models, job.id)) == before
    bare = await running_at(models, await new_job(models, max_attempts=1), "n1", range(1, 5))
    await store.transition(models, bare.id, JobState.RUNNING, JobState.CANCELLED)
    before = (await _get(models, bare.id), await events(models, bare.id))
    with pytest.raises(store.NotResumableError, match=r"no checkpoint stored.*submit it again"):
        await job_writes.resume_job(models, bare.id, 1)
    assert (await _get(models, bare.id), await events(models, bare.id)) == before
    # With an adapter (its GGUF failed), the way on is a new job from it.
    made = await running_at(models, await new_job(models, model="tiny-gguf"), "n1", range(1, 3))
    await job_writes.record_artifact(models, made.id, ArtifactKind.PEFT, 5, SHA)
    await store.transition(models, made.id, JobState.RUNNING, JobState.FAILED, "no gguf")
    with pytest.raises(
        store.NotResumableError, match=f"submit a new job with resume_from {made.id}"
    ):
        await job_writes.resume_job(models, made.id, 1)


async def test_resume_queues_a_failed_job_from_its_checkpoint_as_a_new_attempt(
    models: Sessions,
) -> None:
    job = await running_at(
        models, await new_job(models, max_attempts=1, node="n1"), "n1", range(1, 9)
    )
    await checkpoint(models, job, 6, 1)
    await store.transition(models, job.id, JobState.RUNNING, JobState.FAILED, "node lost")
    resumed, move = await job_writes.resume_job(models, job.id, 2, "the node is back")
    assert resumed.state is JobState.QUEUED and resumed.finished_at is None
    assert resumed.max_attempts == 3 and resumed.attempt == 1 and resumed.node == "n1"
    assert resumed.message == (
        "resumed by hand: the node is back; attempt 2 of 3 resumes from the checkpoint at step 6"
    )
    assert (move.from_state, move.to_state) == (JobState.FAILED, JobState.QUEUED)
    again = await running_at(models, resumed, "n1", range(7, 9))
    assert again.attempt == 2
    assert [p.attempt for p in (await store.curve(models, job.id)).points][-2:] == [2, 2]
