"""An agent restarted mid-job: its job fails as lost (reconcile), the new agent
takes the next one. The node timeout is longer here (6 s) so that the agent is
surely back before its last beat expires on a loaded machine: the node never
looks lost, only its heartbeats stop naming the job."""

from __future__ import annotations

from typing import Any

import pytest

from lorafleet_schemas.messages import JobState
from tests.system.conftest import Stack, kill_agent, start_requests
from tests.system.test_faults import FINISHED, SLOW


@pytest.fixture
def stack_settings() -> dict[str, Any]:
    return {"node_timeout_s": 6}


async def test_agent_restarted_mid_job_fails_it_as_lost_and_takes_the_next(stack: Stack) -> None:
    await stack.add_model()
    agent = await stack.agent("node-1", env=SLOW)
    job = await stack.submit("node-1")
    await stack.wait_state(job.id, JobState.RUNNING)
    kill_agent(agent)
    # Back before its last beat expires (6 s): the node never looks lost, but
    # its heartbeats now name no job.
    new_agent = await stack.agent("node-1", env={"LORAFLEET_STANDIN_STEPS": "3"})
    failed = await stack.wait_state(job.id, JobState.FAILED, timeout_s=15)
    assert "node-1" in failed.message
    assert "the agent on node-1 restarted" in failed.message, failed.message
    nxt = await stack.submit("node-1")
    done = await stack.wait_state(nxt.id, *FINISHED, JobState.FAILED)
    assert done.state in FINISHED, done.message
    assert start_requests(new_agent) == [nxt.id]
