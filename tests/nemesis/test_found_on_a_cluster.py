"""What the nemesis found that needs the three-server cluster, each pinned
by a test of its own (beside its seed in test_nemesis_run.py). The cluster
and the cut are tests/cluster's own."""

from __future__ import annotations

import asyncio
import os
import signal

from lorafleet.names import kv_stream
from lorafleet.nats.cluster import NatsCluster
from lorafleet_schemas.messages import JobState
from tests.cluster import conftest as cluster_tests
from tests.cluster.helpers import (  # noqa: F401 (control_plane_on_the_first_two: a fixture)
    END_TIMEOUT_S,
    FINISHED,
    TRAINING,
    control_plane_on_the_first_two,
    cut_off,
    lead_elsewhere,
    no_false_loss,
    story,
)
from tests.procs import ServiceProcess
from tests.system.conftest import Stack

#: tests/cluster's fixtures: the cluster, and the stack's server its first member.
nats_cluster = cluster_tests.nats_cluster
nats_server = cluster_tests.nats_server

#: Starts of a scheduler until its watch's consumer is on its own member
#: (the server places a one-copy consumer on any of the stream's three).
PLACEMENT_TRIES = 12
#: Seconds the agent's server stays frozen: past the node timeout (3 s).
FROZEN_S = 5.0
#: Seconds the scheduler's member stays cut off. Its lease ends within 2.5 s;
#: its round then waits on the recorder (beyond the cut) for some 5 s, which
#: its rounds take for their own stall and forgive; a sweep 3.5 s after that
#: is what lost every node.
CUT_S = 10.0


async def test_the_agents_server_frozen_is_no_node_loss(
    stack: Stack, nats_cluster: NatsCluster
) -> None:
    """Seed 3: a member SIGSTOPped for 3.4 s lost the node whose agent was on
    it: the frozen server answered no PING, so the agent took it for its own
    link cut and waited, and its beat expired. It now moves to another member
    (a cut link lets it reach none, and it fences as before)."""
    await stack.add_model()
    victim = nats_cluster.servers[nats_cluster.names[2]]
    # Given one URL, as an operator might: the server tells it the others.
    agent = await stack.agent("node-1", env=TRAINING, nats_url=victim.url)
    job = await stack.submit("node-1")
    await stack.wait_state(job.id, JobState.RUNNING)
    assert victim.proc is not None
    os.kill(victim.proc.pid, signal.SIGSTOP)
    try:
        await asyncio.sleep(FROZEN_S)
    finally:
        os.kill(victim.proc.pid, signal.SIGCONT)
    done = await stack.wait_state(job.id, *FINISHED, JobState.FAILED, timeout_s=END_TIMEOUT_S)
    assert done.state in FINISHED, f"{done.message}\n{story(*stack.schedulers, agent)}"
    try:
        no_false_loss(stack, agent)
    except AssertionError as e:
        raise AssertionError(f"{e}\n{story(*stack.schedulers, agent)}") from None
    assert agent.events("nats.moved"), "the agent never left the frozen server"


async def test_a_leading_scheduler_on_a_cut_off_member_loses_no_node(
    stack: Stack, nats_cluster: NatsCluster
) -> None:
    """Seed 3: a scheduler on a member cut off from the other two judged all
    three nodes lost by its sweep, 4.4 s into the cut. That member led the
    nodes bucket's stream and kept answering its probe as if nothing were
    wrong; no beat reached it. The sweep now judges silence as of this
    scheduler's last write that reached the majority (its lease's renewal)."""
    await stack.add_model()
    first, second, victim = nats_cluster.names
    agent = await stack.agent("node-1", env=TRAINING, nats_url=nats_cluster.servers[first].url)
    [elsewhere] = stack.schedulers
    await elsewhere.stop()  # it resigns: the one on the victim leads
    for avoid in (first, second):  # the nodes bucket led from the victim, as in seed 3
        await lead_elsewhere(stack, victim, avoid)
    on_victim = await scheduler_watching_from(stack, nats_cluster, victim)
    await on_victim.wait_for_event("leader.acquired")
    await stack.scheduler()  # to take over on the majority's side
    job = await stack.submit("node-1")
    await stack.wait_state(job.id, JobState.RUNNING)
    async with cut_off(nats_cluster, victim):
        await asyncio.sleep(CUT_S)
    done = await stack.wait_state(job.id, *FINISHED, JobState.FAILED, timeout_s=END_TIMEOUT_S)
    assert done.state in FINISHED, f"{done.message}\n{story(*stack.schedulers, agent)}"
    assert on_victim.events("leader.lost"), "the cut-off scheduler kept its lease"
    try:
        no_false_loss(stack, agent)
    except AssertionError as e:
        raise AssertionError(f"{e}\n{story(*stack.schedulers, agent)}") from None


async def scheduler_watching_from(
    stack: Stack, cluster: NatsCluster, member: str
) -> ServiceProcess:
    """A scheduler connected to `member` alone whose node watch's consumer is
    on `member` too: cut off, it still hears from that consumer, as in seed 3
    (its consumer elsewhere, its probe fails and its view goes blind)."""
    for _ in range(PLACEMENT_TRIES):
        proc = await stack.scheduler(nats_url=cluster.servers[member].url)
        await proc.wait_for_event("node.up")  # its watch delivers
        if await watch_consumer_member(stack, cluster, member) == member:
            return proc
        await proc.stop()
        stack.schedulers.remove(proc)
    raise AssertionError(f"no scheduler's watch consumer was placed on {member}")


async def watch_consumer_member(stack: Stack, cluster: NatsCluster, member: str) -> str | None:
    """Where the node watch of the scheduler connected to `member` has its
    consumer: the consumer that pushes to one of that client's subscriptions."""
    connz = await cluster.monitor(member, "/connz?subs=true&limit=1024")
    subs = {
        sub
        for c in connz.get("connections") or []
        if c.get("name") == "lorafleet-scheduler"
        for sub in c.get("subscriptions_list") or []
    }
    stream = kv_stream(stack.settings.names.nodes_bucket)
    jsz = await cluster.monitor(
        member, "/jsz?accounts=true&streams=true&consumers=true&config=true"
    )
    for account in jsz.get("account_details") or []:
        for detail in account.get("stream_detail") or []:
            if detail.get("name") != stream:
                continue
            for consumer in detail.get("consumer_detail") or []:
                if consumer.get("config", {}).get("deliver_subject") in subs:
                    leader = consumer.get("cluster", {}).get("leader")
                    return str(leader) if leader else None
    return None
