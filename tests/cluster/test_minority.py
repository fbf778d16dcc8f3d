"""A member cut off from the other two while its clients stay connected to
it (a minority partition): the agent on it must not be judged lost. Its
beats fail while the server answers, so it moves to another member within
the node timeout; the control plane runs on the other two."""

from __future__ import annotations

from lorafleet.nats.cluster import NatsCluster
from lorafleet_schemas.messages import JobState
from tests.cluster.helpers import (  # noqa: F401 (control_plane_on_the_first_two: a fixture)
    END_TIMEOUT_S,
    FINISHED,
    TRAINING,
    assert_each_step_once,
    control_plane_on_the_first_two,
    cut_off,
    no_false_loss,
    story,
)
from tests.system.conftest import Stack


async def test_the_agents_server_cut_off_is_no_node_loss(
    stack: Stack, nats_cluster: NatsCluster
) -> None:
    await stack.add_model()
    victim = nats_cluster.names[2]
    # Given one URL, as an operator might: the server tells it the others.
    agent = await stack.agent("node-1", env=TRAINING, nats_url=nats_cluster.servers[victim].url)
    job = await stack.submit("node-1")
    await stack.wait_state(job.id, JobState.RUNNING)
    async with cut_off(nats_cluster, victim):
        done = await stack.wait_state(job.id, *FINISHED, JobState.FAILED, timeout_s=END_TIMEOUT_S)
        assert done.state in FINISHED, f"{done.message}\n{story(*stack.schedulers, agent)}"
        no_false_loss(stack, agent)
        assert agent.events("nats.moved"), "the agent never left the cut-off server"
        await assert_each_step_once(stack, job.id, 100)
