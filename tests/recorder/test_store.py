"""The store on PostgreSQL and SQLite: transitions, status reports, artifacts."""

from __future__ import annotations

import asyncio
import datetime as dt
import random

import pytest

from lorafleet.errors import NotFoundError
from lorafleet.states import IllegalTransitionError
from lorafleet_schemas.messages import (
    ArtifactKind,
    Engine,
    JobRecord,
    JobSpec,
    JobState,
    ModelSpec,
    Replicas,
    StatusReport,
)
from lorafleet_services.recorder import job_writes, store
from lorafleet_services.recorder.db import Sessions

SHA = "0" * 64
T0 = dt.datetime(2026, 1, 1, tzinfo=dt.UTC)


async def new_job(sm: Sessions, model: str = "tiny-vllm", node: str | None = None) -> JobRecord:
    m = await store.get_model(sm, model)
    assert m is not None
    spec = JobSpec(model=model, gpu_memory_mib=1000, node=node, data="x")
    return await store.create_job(sm, spec, m, f"sha256/{SHA}", SHA, 3)


async def started(sm: Sessions, model: str = "tiny-vllm", node: str = "n1") -> JobRecord:
    job = await new_job(sm, model)
    applied, job = await store.transition(sm, job.id, JobState.QUEUED, JobState.STARTING, node=node)
    assert applied
    return job


def rep(job: JobRecord, seq: int, node: str | None = None, **kw: object) -> StatusReport:
    return StatusReport(
        job_id=job.id,
        node=node or job.node or "n1",
        attempt=job.attempt,
        seq=seq,
        time=T0 + dt.timedelta(seconds=seq),
        **kw,  # type: ignore[arg-type]
    )


def training_reports(job: JobRecord, steps: int = 20) -> list[StatusReport]:
    """What an agent sends for a run: preparing, running, steps with loss, uploading."""
    out = [
        rep(job, 1, state=JobState.PREPARING, message="loading"),
        rep(job, 2, state=JobState.RUNNING),
    ]
    for i in range(1, steps + 1):
        out.append(
            rep(
                job, 2 + i, step=i, steps=steps, loss=3.0 - i * 0.1,
                learning_rate=1e-4, tokens_per_s=100.0 + i, peak_mib=500 + (i * 37) % 200,
            )
        )  # fmt: skip
    out.append(rep(job, steps + 3, step=steps, eval_loss=1.25))
    out.append(rep(job, steps + 4, state=JobState.UPLOADING, message="delivering"))
    return out


def comparable(job: JobRecord) -> dict[str, object]:
    return {
        k: getattr(job, k)
        for k in ("state", "message", "step", "steps", "loss", "eval_loss", "peak_mib", "node")
    }


async def test_a_list_pages_with_after_in_either_order(models: Sessions) -> None:
    made = {(await new_job(models, "tiny-vllm")).id for _ in range(5)}
    for oldest_first in (False, True):
        want = [j.id for j in await store.list_jobs(models, oldest_first=oldest_first)]
        assert set(want) == made
        pages: list[list[str]] = []
        after: str | None = None
        for _ in range(5):
            page = await store.list_jobs(models, limit=2, oldest_first=oldest_first, after=after)
            pages.append([j.id for j in page])
            if len(page) < 2:
                break
            after = page[-1].id
        assert pages == [want[0:2], want[2:4], want[4:]], (oldest_first, pages)
    with pytest.raises(NotFoundError, match="give the last id of a page"):
        await store.list_jobs(models, after="nope")


async def test_placed_lists_the_jobs_a_serving_policy_places(models: Sessions) -> None:
    """Their own policy, else their model's default; never `serve: false`;
    no policy anywhere (JSON null, as the column stores None) is not placed."""
    await store.add_model(models, ModelSpec(name="everywhere", engine=Engine.VLLM,
                                            hf_repo="x/tiny", serving="all"))  # fmt: skip

    async def job(model: str, **spec: object) -> str:
        m = await store.get_model(models, model)
        assert m is not None
        made = JobSpec(model=model, gpu_memory_mib=1000, data="x", **spec)  # type: ignore[arg-type]
        return (await store.create_job(models, made, m, f"sha256/{SHA}", SHA, 3)).id

    own = await job("tiny-vllm", serving=Replicas(replicas=2))
    own_all = await job("tiny-vllm", serving="all", serve=True)
    by_default = await job("everywhere")
    await job("tiny-vllm")  # no policy: served where it trained
    await job("tiny-vllm", serve=False, serving="all")  # serve: false wins
    await job("everywhere", serve=False)
    placed = await store.list_jobs(models, placed=True)
    assert {j.id for j in placed} == {own, own_all, by_default}
    assert len(await store.list_jobs(models)) == 6


async def test_create_get_list_filters(models: Sessions) -> None:
    a = await new_job(models, "tiny-vllm", node="n1")
    b = await new_job(models, "tiny-gguf")
    assert a.artifacts_expected == [ArtifactKind.PEFT]
    assert b.artifacts_expected == [ArtifactKind.PEFT, ArtifactKind.GGUF]
    got = await store.get_job(models, a.id)
    assert got is not None and got.id == a.id and got.created_at.tzinfo is not None
    assert [j.id for j in await store.list_jobs(models)] == [b.id, a.id]
    assert [j.id for j in await store.list_jobs(models, oldest_first=True)] == [a.id, b.id]
    assert [j.id for j in await store.list_jobs(models, node="n1")] == [a.id]
    assert [j.id for j in await store.list_jobs(models, model="tiny-gguf")] == [b.id]
    assert [j.id for j in await store.list_jobs(models, limit=1)] == [b.id]
    await store.transition(models, b.id, JobState.QUEUED, JobState.STARTING, node="n2")
    assert [j.id for j in await store.list_jobs(models, state=JobState.STARTING)] == [b.id]
    both = await store.list_jobs(models, states=[JobState.STARTING, JobState.QUEUED])
    assert {j.id for j in both} == {a.id, b.id}
    assert await store.get_job(models, "nope") is None


async def test_duplicate_model_refused(models: Sessions) -> None:
    from lorafleet_schemas.messages import Engine, ModelSpec

    with pytest.raises(store.ModelExistsError):
        await store.add_model(models, ModelSpec(name="tiny-vllm", engine=Engine.VLLM, hf_repo="y"))
    assert [m.name for m in await store.list_models(models)] == ["tiny-gguf", "tiny-vllm"]


async def test_transition_cas_and_rules(models: Sessions) -> None:
    job = await new_job(models)
    applied, job = await store.transition(
        models, job.id, JobState.QUEUED, JobState.STARTING, "placed", node="n1"
    )
    assert applied and job.state is JobState.STARTING and job.node == "n1"
    assert job.attempt == 1 and job.started_at is not None
    # The job moved on: a transition from the old state is not applied.
    applied, again = await store.transition(models, job.id, JobState.QUEUED, JobState.STARTING)
    assert not applied and again.state is JobState.STARTING and again.attempt == 1
    # Another node cannot move it.
    applied, _ = await store.transition(
        models, job.id, JobState.STARTING, JobState.FAILED, node="n2"
    )
    assert not applied
    with pytest.raises(IllegalTransitionError):
        await store.transition(models, job.id, JobState.STARTING, JobState.QUEUED)
    with pytest.raises(IllegalTransitionError):
        await store.transition(models, job.id, JobState.UPLOADING, JobState.DONE)
    applied, job = await store.transition(
        models, job.id, JobState.STARTING, JobState.CANCELLED, "by user"
    )
    assert applied and job.finished_at is not None and job.message == "by user"
    with pytest.raises(IllegalTransitionError, match="final"):
        await store.transition(models, job.id, JobState.CANCELLED, JobState.FAILED)
    with pytest.raises(store.NoSuchJobError):
        await store.transition(models, "nope", JobState.QUEUED, JobState.STARTING)
    curve = await store.curve(models, job.id)
    assert [(e.from_state, e.to_state) for e in curve.events] == [
        (None, JobState.QUEUED),
        (JobState.QUEUED, JobState.STARTING),
        (JobState.STARTING, JobState.CANCELLED),
    ]


async def test_racing_transitions_exactly_one_wins(models: Sessions) -> None:
    for _ in range(5):
        job = await new_job(models)
        results = await asyncio.gather(
            *(
                store.transition(models, job.id, JobState.QUEUED, JobState.STARTING, node=f"n{i}")
                for i in range(6)
            )
        )
        winners = [j for applied, j in results if applied]
        assert len(winners) == 1
        final = await store.get_job(models, job.id)
        assert final is not None and final.node == winners[0].node and final.attempt == 1
        curve = await store.curve(models, job.id)
        assert [e.to_state for e in curve.events] == [JobState.QUEUED, JobState.STARTING]
    # Racing a cancel against a start: one of the two, never both.
    job = await new_job(models)
    (a, _), (b, _) = await asyncio.gather(
        store.transition(models, job.id, JobState.QUEUED, JobState.STARTING, node="n1"),
        store.transition(models, job.id, JobState.QUEUED, JobState.CANCELLED),
    )
    assert a != b


async def test_status_in_order(models: Sessions) -> None:
    job = await started(models)
    result = await job_writes.apply_status(models, training_reports(job))
    assert not result.refused
    got = await store.get_job(models, job.id)
    assert got is not None
    assert got.state is JobState.UPLOADING
    assert (got.step, got.steps, got.eval_loss) == (20, 20, 1.25)
    assert got.loss == pytest.approx(1.0)
    assert got.peak_mib == max(500 + (i * 37) % 200 for i in range(1, 21))
    assert got.message == "delivering"
    curve = await store.curve(models, job.id)
    assert [p.step for p in curve.points] == list(range(1, 21))
    assert [(p.step, p.eval_loss) for p in curve.evals] == [(20, 1.25)]
    assert [e.to_state for e in curve.events][-3:] == [
        JobState.PREPARING,
        JobState.RUNNING,
        JobState.UPLOADING,
    ]
    [change] = result.changes
    assert change.kind == "state" and change.job.state is JobState.UPLOADING


async def test_each_evaluation_is_kept_once_for_the_eval_curve(models: Sessions) -> None:
    job = await started(models)
    reports = [
        rep(job, 1, state=JobState.RUNNING),
        rep(job, 2, step=1, steps=2, loss=2.0),
        rep(job, 3, step=1, eval_loss=1.5),
        rep(job, 4, step=2, steps=2, loss=1.0),
        rep(job, 5, step=2, eval_loss=1.25),
    ]
    await job_writes.apply_status(models, reports[::-1])
    await job_writes.apply_status(models, reports)  # repeated: stored once
    curve = await store.curve(models, job.id)
    assert [(p.step, p.eval_loss) for p in curve.evals] == [(1, 1.5), (2, 1.25)]


async def test_status_repeated_and_shuffled_same_result(models: Sessions) -> None:
    base = await started(models)
    await job_writes.apply_status(models, training_reports(base))
    expected_job = await store.get_job(models, base.id)
    expected_curve = await store.curve(models, base.id)
    assert expected_job is not None
    rng = random.Random(7)
    for trial in range(3):
        job = await started(models)
        reports = training_reports(job) * 2
        rng.shuffle(reports)
        # In batches of varied size, as the consumer fetches them.
        i = 0
        while i < len(reports):
            n = rng.randint(1, 9)
            await job_writes.apply_status(models, reports[i : i + n])
            i += n
        got = await store.get_job(models, job.id)
        assert got is not None
        assert comparable(got) == comparable(expected_job), trial
        curve = await store.curve(models, job.id)
        assert curve.points == expected_curve.points
        assert curve.evals == expected_curve.evals
    # Applying everything again changes nothing at all.
    before = await store.get_job(models, job.id)
    result = await job_writes.apply_status(models, training_reports(job))
    assert result.changes == []
    assert await store.get_job(models, job.id) == before


async def test_wrong_node_or_attempt_refused(models: Sessions) -> None:
    job = await started(models)
    result = await job_writes.apply_status(
        models,
        [
            rep(job, 1, node="intruder", state=JobState.RUNNING, step=1, loss=1.0, peak_mib=9999),
            StatusReport(job_id=job.id, node="n1", attempt=7, seq=1, time=T0, peak_mib=9999),
            StatusReport(job_id="nope", node="n1", attempt=1, seq=1, time=T0),
        ],
    )
    assert len(result.refused) == 3 and result.changes == []
    assert "runs on node n1, not intruder" in result.refused[0][1]
    got = await store.get_job(models, job.id)
    assert got is not None and got.state is JobState.STARTING and got.peak_mib == 0
    assert (await store.curve(models, job.id)).points == []
    # A queued job (no node yet) takes no report either.
    queued = await new_job(models)
    result = await job_writes.apply_status(
        models, [StatusReport(job_id=queued.id, node="n1", attempt=0, seq=1, time=T0)]
    )
    assert len(result.refused) == 1


async def test_peak_only_grows(models: Sessions) -> None:
    job = await started(models)
    await job_writes.apply_status(models, [rep(job, 1, peak_mib=800)])
    await job_writes.apply_status(models, [rep(job, 2, peak_mib=300)])
    got = await store.get_job(models, job.id)
    assert got is not None and got.peak_mib == 800
    await job_writes.apply_status(models, [rep(job, 3, peak_mib=900), rep(job, 4, peak_mib=100)])
    got = await store.get_job(models, job.id)
    assert got is not None and got.peak_mib == 900


async def test_final_job_never_changes(models: Sessions) -> None:
    job = await started(models)
    await job_writes.apply_status(
        models, [rep(job, 1, state=JobState.RUNNING), rep(job, 2, step=1, loss=2.0)]
    )
    applied, job = await store.transition(models, job.id, JobState.RUNNING, JobState.CANCELLED)
    assert applied
    before = await store.get_job(models, job.id)
    result = await job_writes.apply_status(
        models,
        [
            rep(job, 3, step=2, loss=1.0, peak_mib=5000),
            rep(job, 4, state=JobState.UPLOADING),
            rep(job, 5, state=JobState.FAILED, message="late"),
        ],
    )
    assert len(result.refused) == 3 and result.changes == []
    assert await store.get_job(models, job.id) == before
    assert [p.step for p in (await store.curve(models, job.id)).points] == [1]
    _, change = await job_writes.record_artifact(models, job.id, ArtifactKind.PEFT, 10, SHA)
    assert change is None
    assert await store.get_job(models, job.id) == before
    # A report never makes a job done.
    other = await started(models)
    result = await job_writes.apply_status(models, [rep(other, 1, state=JobState.DONE)])
    assert len(result.refused) == 1
    got = await store.get_job(models, other.id)
    assert got is not None and got.state is JobState.STARTING


@pytest.mark.parametrize("uploading_first", [True, False])
async def test_done_only_when_every_artifact_stored(
    models: Sessions, uploading_first: bool
) -> None:
    job = await started(models, "tiny-gguf")
    await job_writes.apply_status(models, [rep(job, 1, state=JobState.RUNNING)])
    uploading = [rep(job, 2, state=JobState.UPLOADING)]
    if uploading_first:
        await job_writes.apply_status(models, uploading)
    got, change = await job_writes.record_artifact(models, job.id, ArtifactKind.PEFT, 10, SHA)
    assert got.state is not JobState.DONE and change is not None and change.kind == "progress"
    # Idempotent: recording it again changes nothing.
    _, change = await job_writes.record_artifact(models, job.id, ArtifactKind.PEFT, 10, SHA)
    assert change is None
    got, change = await job_writes.record_artifact(models, job.id, ArtifactKind.GGUF, 10, SHA)
    if uploading_first:
        assert got.state is JobState.DONE and change is not None and change.kind == "state"
    else:
        assert got.state is JobState.RUNNING
        result = await job_writes.apply_status(models, uploading)
        [change2] = result.changes
        assert change2.job.state is JobState.DONE
        assert [m.to_state for m in change2.moves] == [JobState.UPLOADING, JobState.DONE]
    final = await store.get_job(models, job.id)
    assert final is not None and final.state is JobState.DONE and final.finished_at is not None
    assert set(final.artifacts_stored) == {ArtifactKind.PEFT, ArtifactKind.GGUF}
    assert final.message == "every artifact is stored and verified: peft, gguf"
    vjob = await started(models, "tiny-vllm")
    with pytest.raises(store.ArtifactKindError):
        await job_writes.record_artifact(models, vjob.id, ArtifactKind.GGUF, 10, SHA)


async def test_concurrent_batches_for_one_job(models: Sessions) -> None:
    """Two consumers (replicated recorders) applying halves at once: the guard serialises."""
    base = await started(models)
    await job_writes.apply_status(models, training_reports(base))
    expected = await store.get_job(models, base.id)
    assert expected is not None
    job = await started(models)
    reports = training_reports(job)
    random.Random(3).shuffle(reports)
    halves = [reports[i::2] for i in range(2)]
    await asyncio.gather(
        *(
            job_writes.apply_status(models, h[i : i + 3])
            for h in halves
            for i in range(0, len(h), 3)
        )
    )
    got = await store.get_job(models, job.id)
    assert got is not None and comparable(got) == comparable(expected)
    assert len((await store.curve(models, job.id)).points) == 20


async def test_every_change_of_a_job_has_a_higher_version(models: Sessions) -> None:
    """What a watcher orders a job's records by: its updated_at can run
    backwards (a writer stamps its time before it waits for the row), the
    version cannot. Each kind of write, as it returns and as it is read."""
    job = await new_job(models, "tiny-gguf")
    seen = [job.version]
    applied, job = await store.transition(
        models, job.id, JobState.QUEUED, JobState.STARTING, node="n1"
    )
    seen.append(job.version)
    result = await job_writes.apply_status(models, [rep(job, 1, state=JobState.RUNNING)])
    seen.append(result.changes[0].job.version)
    result = await job_writes.apply_status(models, [rep(job, 2, step=1, steps=9, loss=2.0)])
    seen.append(result.changes[0].job.version)
    got, _ = await job_writes.record_artifact(
        models, job.id, ArtifactKind.CHECKPOINT, 10, SHA, step=1, attempt=1, object_name="o"
    )
    seen.append(got.version)
    got, _ = await job_writes.record_artifact(models, job.id, ArtifactKind.PEFT, 10, SHA)
    seen.append(got.version)
    applied, got = await store.transition(models, job.id, JobState.RUNNING, JobState.CANCELLED)
    seen.append(got.version)
    got, _ = await job_writes.resume_job(models, job.id, 1)
    seen.append(got.version)
    assert applied and seen == list(range(1, len(seen) + 1)), seen
    read = await store.get_job(models, job.id)
    assert read is not None and read.version == seen[-1]
