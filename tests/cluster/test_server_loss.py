"""A job trains while a NATS server dies: the bucket's leader, the meta
leader, the agent's own server. Each job ends done, each loss step is
recorded once, and nobody is judged lost: an outage of the heartbeat
bucket (an election, about 5 s, longer than the 3 s node timeout) is not
a node loss."""

from __future__ import annotations

import asyncio
import signal

import nats

from lorafleet.names import kv_stream
from lorafleet.nats.cluster import NatsCluster
from lorafleet_schemas.messages import JobState
from tests.cluster.helpers import (
    END_TIMEOUT_S,
    FINISHED,
    TRAINING,
    assert_artifacts_intact,
    assert_each_step_once,
    connected_member,
    lead_elsewhere,
    leader_of,
    no_false_loss,
    story,
)
from tests.consumers import redeliveries
from tests.eventually import eventually
from tests.system.conftest import Stack, has_artifact_store

#: Seconds a killed server stays down before it is restarted.
DOWN_S = 3.0


async def _train_through(
    stack: Stack, cluster: NatsCluster, pick: str, restart: bool = True
) -> None:
    await stack.add_model()
    agent = await stack.agent("node-1", env=TRAINING)
    job = await stack.submit("node-1")
    await stack.wait_state(job.id, JobState.RUNNING)
    if pick == "bucket":
        victim = await leader_of(stack, kv_stream(stack.settings.names.nodes_bucket))
    elif pick == "status":
        victim = await leader_of(stack, stack.settings.names.status_stream)
    elif pick == "meta":
        victim = await cluster.meta_leader() or cluster.names[0]
    else:
        victim = await connected_member(cluster, "lorafleet-agent-node-1")
    await cluster.kill(victim)
    if restart:
        await asyncio.sleep(DOWN_S)
        await cluster.restart(victim)
    done = await stack.wait_state(job.id, *FINISHED, JobState.FAILED, timeout_s=END_TIMEOUT_S)
    assert done.state in FINISHED, f"{done.message}\n{story(*stack.schedulers, agent)}"
    no_false_loss(stack, agent)
    await assert_each_step_once(stack, job.id, 100)
    if has_artifact_store():
        await assert_artifacts_intact(stack, job.id)


async def test_kill_the_heartbeat_buckets_leader(stack: Stack, nats_cluster: NatsCluster) -> None:
    await _train_through(stack, nats_cluster, "bucket")


async def test_kill_the_meta_leader(stack: Stack, nats_cluster: NatsCluster) -> None:
    await _train_through(stack, nats_cluster, "meta")


async def test_kill_the_agents_server(stack: Stack, nats_cluster: NatsCluster) -> None:
    await _train_through(stack, nats_cluster, "agent")


async def test_kill_the_status_streams_leader(stack: Stack, nats_cluster: NatsCluster) -> None:
    await _train_through(stack, nats_cluster, "status")


async def test_two_of_three_left_and_the_system_goes_on(
    stack: Stack, nats_cluster: NatsCluster
) -> None:
    await _train_through(stack, nats_cluster, "bucket", restart=False)
    nxt = await stack.submit("node-1", params={"max_steps": 5})
    done = await stack.wait_state(nxt.id, *FINISHED, JobState.FAILED, timeout_s=END_TIMEOUT_S)
    assert done.state in FINISHED, done.message


async def test_a_rolling_restart_while_a_job_trains(
    stack: Stack, nats_cluster: NatsCluster
) -> None:
    await stack.add_model()
    agent = await stack.agent("node-1", env={"LORAFLEET_STANDIN_STEP_S": "0.1"})
    job = await stack.submit("node-1", params={"max_steps": 200})
    await stack.wait_state(job.id, JobState.RUNNING)
    for member in nats_cluster.names:  # an upgrade: one at a time, each back before the next
        await nats_cluster.restart(member, kill=False)
    done = await stack.wait_state(job.id, *FINISHED, JobState.FAILED, timeout_s=END_TIMEOUT_S)
    assert done.state in FINISHED, f"{done.message}\n{story(*stack.schedulers, agent)}"
    no_false_loss(stack, agent)
    await assert_each_step_once(stack, job.id, 200)


async def test_reports_sent_into_a_dying_server_come_back(
    stack: Stack, nats_cluster: NatsCluster
) -> None:
    """The recorder's server freezes with reports on their way to the recorder
    and then dies. The server had sent them (the consumer waits for their
    acks), the recorder never got them: they come back after the ack wait
    and every step is recorded once. A rolling restart once left step 1 out
    of a done job's curve this way, when the check did not wait that long."""
    await stack.add_model()
    victim = await connected_member(nats_cluster, "lorafleet-recorder")
    other = next(m for m in nats_cluster.names if m != victim)
    # The victim only relays to the recorder: the agent, the stream, the
    # bucket and the consumer are elsewhere, so reports go on while it is frozen.
    await lead_elsewhere(stack, other, victim)
    # 15 s of reports: long enough for every freeze tried (FREEZE_TRIES).
    steps = {"LORAFLEET_STANDIN_STEPS": "300", "LORAFLEET_STANDIN_STEP_S": "0.05"}
    agent = await stack.agent("node-1", env=steps, nats_url=nats_cluster.servers[other].url)
    job = await stack.submit("node-1")

    async def recorded() -> int:
        return (await stack.get(job.id)).step

    await eventually(recorded, "the first steps", until=lambda step: step >= 10)
    await _freeze_with_reports_inside(stack, nats_cluster, victim, other)
    await nats_cluster.kill(victim)
    done = await stack.wait_state(job.id, *FINISHED, JobState.FAILED, timeout_s=END_TIMEOUT_S)
    assert done.state in FINISHED, f"{done.message}\n{story(*stack.schedulers, agent)}"
    no_false_loss(stack, agent)
    await assert_each_step_once(stack, job.id, 300)
    names = stack.settings.names
    info = await stack.js.consumer_info(names.status_stream, names.recorder_consumer)
    assert redeliveries(info) > 0, "no report went into the frozen server: nothing was tried"


async def test_kill_the_artifacts_streams_leader_as_delivery_begins(
    stack: Stack, nats_cluster: NatsCluster
) -> None:
    await stack.add_model()
    # 1 KiB chunks: the stand-in's adapter goes out in about 70 of them.
    agent = await stack.agent("node-1", env=TRAINING, chunk_bytes=1024)
    job = await stack.submit("node-1")

    async def nearly_trained() -> bool:
        return (await stack.get(job.id)).step >= 97

    await eventually(nearly_trained, "the last steps", timeout_s=END_TIMEOUT_S)
    # The election (about 5 s) overlaps the whole delivery.
    victim = await leader_of(stack, stack.settings.names.artifacts_stream)
    await nats_cluster.kill(victim)
    await asyncio.sleep(DOWN_S)
    await nats_cluster.restart(victim)
    done = await stack.wait_state(job.id, *FINISHED, JobState.FAILED, timeout_s=END_TIMEOUT_S)
    assert done.state in FINISHED, f"{done.message}\n{story(*stack.schedulers, agent)}"
    no_false_loss(stack, agent)
    if has_artifact_store():
        await assert_artifacts_intact(stack, job.id)


#: Freezes tried before the test gives up on catching a report inside one.
FREEZE_TRIES = 5


async def _freeze_with_reports_inside(
    stack: Stack, cluster: NatsCluster, victim: str, other: str
) -> None:
    """Freeze `victim` until the consumer has sent reports into it. Reports
    flow (20 a second), and each of the recorder's fetches stays open at the
    consumer for a quarter second (FETCH_WAIT_S), but a freeze between two
    fetches catches none (a loaded CI run did): the consumer's acks pending,
    read through `other`, say whether this freeze holds some; if not, the
    server goes on and is frozen again."""
    proc = cluster.servers[victim].proc
    assert proc is not None
    names = stack.settings.names
    nc = await nats.connect(cluster.servers[other].url)
    try:
        js = nc.jetstream()
        for _ in range(FREEZE_TRIES):
            proc.send_signal(signal.SIGSTOP)
            await asyncio.sleep(1.0)
            info = await js.consumer_info(names.status_stream, names.recorder_consumer)
            if info.num_ack_pending > 0:
                return
            proc.send_signal(signal.SIGCONT)
            await asyncio.sleep(0.5)
    finally:
        await nc.close()
    raise AssertionError(f"no report went into {victim} in {FREEZE_TRIES} freezes of 1 s")
