"""A job through the whole system: submit -> scheduler -> agent -> recorder."""

from __future__ import annotations

import asyncio

from lorafleet_schemas.messages import JobState
from tests.system.conftest import Stack, has_artifact_store, start_requests

FINISHED = (JobState.DONE, JobState.UPLOADING) if not has_artifact_store() else (JobState.DONE,)


async def test_a_queued_job_runs_on_its_node_and_lands_in_the_recorder(stack: Stack) -> None:
    await stack.add_model()
    await stack.agent("node-1", env={"LORAFLEET_STANDIN_STEPS": "6"})
    job = await stack.submit("node-1")
    assert job.state is JobState.QUEUED

    done = await stack.wait_state(job.id, *FINISHED, JobState.FAILED, JobState.CANCELLED)
    assert done.state in FINISHED, done.message
    assert done.node == "node-1"
    assert done.attempt == 1
    assert done.step == 6 and done.steps == 6
    assert done.loss is not None and done.loss < 2.5
    assert done.peak_mib >= 100
    curve = await stack.curve(job.id)
    assert [p.step for p in curve.points] == [1, 2, 3, 4, 5, 6]
    assert all(b.loss < a.loss for a, b in zip(curve.points, curve.points[1:], strict=False))
    path = [e.to_state for e in curve.events]
    assert path[:4] == [JobState.QUEUED, JobState.STARTING, JobState.PREPARING, JobState.RUNNING]
    assert start_requests(stack.agents["node-1"]) == [job.id]


async def test_two_jobs_for_one_node_the_second_waits_then_runs(stack: Stack) -> None:
    await stack.add_model()
    await stack.agent(
        "node-1", env={"LORAFLEET_STANDIN_STEPS": "10", "LORAFLEET_STANDIN_STEP_S": "0.2"}
    )
    first = await stack.submit("node-1")
    second = await stack.submit("node-1")
    await stack.wait_state(first.id, JobState.RUNNING)
    # While the first runs, the second stays queued, saying what it waits for.
    await asyncio.sleep(1.0)
    waiting = await stack.get(second.id)
    assert waiting.state is JobState.QUEUED
    assert "node-1" in waiting.message and first.id in waiting.message
    done = await stack.wait_state(second.id, *FINISHED, JobState.FAILED)
    assert done.state in FINISHED, done.message
    first_now = await stack.get(first.id)
    assert first_now.state in FINISHED
    assert first_now.finished_at is None or done.started_at is not None
    assert start_requests(stack.agents["node-1"]) == [first.id, second.id]
