"""A member cut off from the other two while its clients stay connected to
it (a minority partition): the agent on it must not be judged lost. Its
beats fail while the server answers, so it moves to another member within
the node timeout; the control plane runs on the other two."""

from __future__ import annotations

from typing import Any

import pytest

from lorafleet.natscluster import NatsCluster
from lorafleet_schemas.messages import JobState
from tests.cluster.helpers import (
    END_TIMEOUT_S,
    FINISHED,
    RECORDER_ACK_WAIT_S,
    TRAINING,
    assert_each_step_once,
    no_false_loss,
    story,
)
from tests.system.conftest import Stack


@pytest.fixture
def stack_settings(nats_cluster: NatsCluster) -> dict[str, Any]:
    """The control plane (and the test's client) on the first two members."""
    return {
        "nats_url": ",".join(nats_cluster.urls(nats_cluster.names[:2])),
        "replicas": 3,
        "recorder_ack_wait_s": RECORDER_ACK_WAIT_S,
    }


async def test_the_agents_server_cut_off_is_no_node_loss(
    stack: Stack, nats_cluster: NatsCluster
) -> None:
    await stack.add_model()
    victim = nats_cluster.names[2]
    # Given one URL, as an operator might: the server tells it the others.
    agent = await stack.agent("node-1", env=TRAINING, nats_url=nats_cluster.servers[victim].url)
    job = await stack.submit("node-1")
    await stack.wait_state(job.id, JobState.RUNNING)
    await nats_cluster.isolate(victim)
    try:
        done = await stack.wait_state(job.id, *FINISHED, JobState.FAILED, timeout_s=END_TIMEOUT_S)
        assert done.state in FINISHED, f"{done.message}\n{story(*stack.schedulers, agent)}"
        no_false_loss(stack, agent)
        assert agent.events("nats.moved"), "the agent never left the cut-off server"
        await assert_each_step_once(stack, job.id, 100)
    finally:
        await nats_cluster.rejoin(victim)
