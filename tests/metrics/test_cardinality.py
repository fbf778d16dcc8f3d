"""Labels bounded by what exists now: after many finished jobs every
endpoint has exactly the series it had after one (a finished job's series
go once their linger is over)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from lorafleet_schemas.messages import JobState
from tests.eventually import eventually
from tests.metrics.endpoints import metrics_url, scrape, series
from tests.system.conftest import Stack

#: Jobs after the first; the issue asks for 50 in all.
MORE_JOBS = 49
#: Seconds a finished job's series stay here.
LINGER_S = 1.5


@pytest.fixture
def stack_settings() -> dict[str, Any]:
    return {"metrics_addr": "127.0.0.1:0", "metrics_linger_s": LINGER_S}


async def all_series(stack: Stack) -> dict[str, set[Any]]:
    procs = {"recorder": stack.recorder, "scheduler": stack.schedulers[0], **stack.agents}
    if stack.artifact_store is not None:
        procs["artifact-store"] = stack.artifact_store
    return {name: series(await scrape(metrics_url(p)), "") for name, p in procs.items()}


def per_job(got: dict[str, set[Any]]) -> list[tuple[str, Any]]:
    return sorted((name, s) for name, found in got.items() for s in found if "job_id" in dict(s[1]))


async def settled(stack: Stack) -> dict[str, set[Any]]:
    """The series once no job's series linger (none has a job_id label)."""
    await asyncio.sleep(LINGER_S)

    async def lingering() -> list[tuple[str, Any]]:
        return per_job(await all_series(stack))

    await eventually(lingering, "no per-job series left", until=lambda found: not found)
    return await all_series(stack)


async def test_fifty_finished_jobs_leave_the_series_of_one(stack: Stack) -> None:
    await stack.agent(
        "node-1", env={"LORAFLEET_STANDIN_STEPS": "1", "LORAFLEET_STANDIN_STEP_S": "0.01"}
    )
    await stack.add_model()
    first = await stack.submit("node-1")
    await stack.wait_state(first.id, JobState.DONE)
    assert per_job(await all_series(stack)), "no per-job series for the job just run"
    after_one = await settled(stack)

    jobs = [await stack.submit("node-1") for _ in range(MORE_JOBS)]
    for job in jobs:
        done = await stack.wait_state(job.id, JobState.DONE, timeout_s=120)
        assert done.state is JobState.DONE
    after_fifty = await settled(stack)
    for name in after_one:
        grew = after_fifty[name] - after_one[name]
        gone = after_one[name] - after_fifty[name]
        assert not grew and not gone, (
            f"{name}: new series {sorted(grew)[:5]}, gone {sorted(gone)[:5]}"
        )
