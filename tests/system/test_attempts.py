"""Attempts with real processes: a start the last leader never sent is sent by
the next one (no attempt lost), and a job whose agent restarted without it
goes back to the queue when it has attempts left and ends done."""

from __future__ import annotations

from typing import Any

import pytest

from lorafleet_schemas.messages import JobState
from tests.system.conftest import Stack, kill_agent, start_requests
from tests.system.test_faults import FINISHED, SLOW


@pytest.fixture
def stack_settings() -> dict[str, Any]:
    # As in test_agent_restart: the restarted agent is back before its last
    # beat expires, so the node never looks lost, only its beats stop naming the job.
    return {"node_timeout_s": 6}


async def test_a_start_the_last_leader_never_sent_is_sent_by_the_next(stack: Stack) -> None:
    (first,) = stack.schedulers
    await first.stop(timeout_s=5)
    await stack.add_model()
    agent = await stack.agent("node-1", env={"LORAFLEET_STANDIN_STEPS": "3"})
    job = await stack.submit("node-1")
    # What a leader SIGKILLed between its compare-and-set and its send leaves.
    reply = await stack.call(
        stack.settings.names.store_transition,
        {"id": job.id, "from_state": "queued", "to_state": "starting", "node": "node-1"},
    )
    assert reply["applied"] and reply["job"]["attempt"] == 1
    scheduler = await stack.scheduler()
    done = await stack.wait_state(job.id, *FINISHED, JobState.FAILED)
    assert done.state in FINISHED, done.message
    assert done.attempt == 1 and start_requests(agent) == [job.id]
    (resent,) = scheduler.events("job.resent")
    assert resent["job_id"] == job.id and resent["attempt"] == 1


async def test_an_agent_restarted_without_the_job_requeues_it_with_attempts_left(
    stack: Stack,
) -> None:
    await stack.add_model()
    agent = await stack.agent("node-1", env=SLOW)
    job = await stack.submit("node-1", max_attempts=2)
    await stack.wait_state(job.id, JobState.RUNNING)
    kill_agent(agent)
    new_agent = await stack.agent("node-1", env={"LORAFLEET_STANDIN_STEPS": "3"})
    done = await stack.wait_state(job.id, *FINISHED, JobState.FAILED, timeout_s=40)
    assert done.state in FINISHED, done.message
    assert done.attempt == 2 and start_requests(new_agent) == [job.id]
    moves = [(e.from_state, e.to_state, e.message) for e in (await stack.curve(job.id)).events]
    requeue = next(m for m in moves if m[1] is JobState.QUEUED and m[0] is not None)
    assert requeue[0] in (JobState.RUNNING, JobState.PREPARING), moves
    assert "the agent on node-1 no longer runs the job" in requeue[2]
    assert "attempt 2 of 2" in requeue[2], requeue
