"""The node is alive, its network is not: a cut link fails the job within
node timeout + 1 s and the agent fences its trainer within the same; after
the link is back the job stays failed and the node runs a new job. A
degraded link (150 ms, 2% loss) is no node loss."""

from __future__ import annotations

import asyncio
import contextlib
import time

import nats.js.errors
import pytest

from lorafleet.client import Client
from lorafleet_schemas.messages import JobState
from tests.eventually import NeverHappenedError, eventually
from tests.partition.helpers import agent_in
from tests.partition.netns import NetnsLink, netem_available, nft_available
from tests.partition.relay import relay_process
from tests.system.conftest import Stack, has_artifact_store, kill_pid, pid_alive, trainer_pids

FINISHED = (JobState.DONE,) if has_artifact_store() else (JobState.DONE, JobState.UPLOADING)
#: Steps of 0.1 s; each job says how many (max_steps), so one agent runs a
#: long job to cut and then a short one.
STEP = {"LORAFLEET_STANDIN_STEP_S": "0.1"}
#: What the issue allows beyond the node timeout, for the failure and the fence.
SLACK_S = 1.0
#: The degraded link: each direction this late, and this share of packets lost.
DELAY_MS = 150
LOSS_PCT = 2.0


async def test_a_cut_link_fails_the_job_and_fences_the_trainer(
    stack: Stack, link: NetnsLink
) -> None:
    await stack.add_model()
    agent = await agent_in(stack, link, "node-1", STEP)
    job = await stack.submit("node-1", params={"max_steps": 300})
    await stack.wait_state(job.id, JobState.RUNNING)
    pids = await eventually(lambda: trainer_pids(agent), "the trainer's pid")
    bound_s = stack.settings.node_timeout_s + SLACK_S
    try:
        link.cut()
        cut_at = time.monotonic()
        failed = await stack.wait_state(job.id, JobState.FAILED, timeout_s=bound_s + 2)
        failed_s = time.monotonic() - cut_at
        await eventually(
            lambda: not any(pid_alive(p) for p in pids), "the trainer gone", timeout_s=bound_s + 2
        )
        stopped_s = time.monotonic() - cut_at
    finally:
        link.restore()
        for pid in pids:
            kill_pid(pid)
    assert "node-1" in failed.message, failed.message
    assert failed_s <= bound_s, failed_s
    assert stopped_s <= bound_s, stopped_s
    assert agent.events("agent.fenced"), agent.tail()
    print(f"cut link: job failed after {failed_s:.2f} s, trainer gone after {stopped_s:.2f} s")
    # The link is back: the node lives again, the job stays failed, a new one runs.
    restored_at = time.monotonic()
    await eventually(lambda: agent.events("agent.unfenced"), "the agent unfenced", timeout_s=20)
    print(f"restored: unfenced after {time.monotonic() - restored_at:.2f} s")
    nxt = await stack.submit("node-1", params={"max_steps": 5})
    done = await stack.wait_state(nxt.id, *FINISHED, JobState.FAILED, timeout_s=60)
    assert done.state in FINISHED, done.message
    assert (await stack.get(job.id)).state is JobState.FAILED


async def test_a_link_cut_during_delivery_leaves_nothing_partial_visible(
    stack: Stack, link: NetnsLink
) -> None:
    """The adapter goes out in 1 KiB chunks over a 64 kbit/s link (about ten
    seconds); the cut comes once the job is uploading. The job fails, and no
    artifact of it is listed or stored — not even after the link is back and
    the agent, unfenced, could send the rest."""
    await stack.add_model()
    link.limit(kbit_s=64)
    env = {**STEP, "LORAFLEET_AGENT_CHUNK_BYTES": "1024"}
    agent = await agent_in(stack, link, "node-1", env)
    job = await stack.submit("node-1", params={"max_steps": 5})
    await stack.wait_state(job.id, JobState.UPLOADING, timeout_s=60)
    link.cut()
    try:
        failed = await stack.wait_state(job.id, JobState.FAILED, JobState.DONE, timeout_s=15)
    finally:
        link.restore()
    assert failed.state is JobState.FAILED, "the delivery ended before the cut: slow it down"
    try:
        await eventually(lambda: agent.events("agent.unfenced"), "the agent back", timeout_s=30)
    except NeverHappenedError as e:
        raise AssertionError(f"{e}\n{agent.tail()}") from None
    client = Client(stack.nc, stack.settings)
    objects = await stack.js.object_store(stack.settings.names.artifacts_bucket)
    for _ in range(3):  # the agent is back: whatever it still sends must stay invisible
        assert await client.artifacts(job.id) == []
        with pytest.raises(nats.js.errors.ObjectNotFoundError):
            await objects.get_info(f"{job.id}/peft")
        await asyncio.sleep(1.0)
    after = await stack.get(job.id)
    assert after.state is JobState.FAILED and after.artifacts_stored == []


async def test_a_degraded_link_is_no_node_loss(stack: Stack, link: NetnsLink) -> None:
    """150 ms each way and 2% of the packets lost each way: by `tc netem` where
    the kernel has it, else by nftables (the loss) and a delaying relay."""
    await stack.add_model()
    async with contextlib.AsyncExitStack() as exits:
        relayed = netem_available(link) is not None
        if not relayed:
            link.degrade(delay_ms=DELAY_MS, loss_pct=LOSS_PCT)
            url, how = None, "tc netem"
        else:
            why = nft_available(link)
            if why is not None:
                pytest.skip(f"no tc netem here and {why}")
            link.drop(LOSS_PCT)
            server = stack.nats_server
            relay = relay_process(link.host_ip, server.host, server.port, DELAY_MS / 1000)
            url = await exits.enter_async_context(relay)
            how = "nftables loss and a delaying relay (no sch_netem here)"
        agent = await agent_in(
            stack,
            link,
            "node-1",
            {"LORAFLEET_STANDIN_STEPS": "40", "LORAFLEET_STANDIN_STEP_S": "0.1"},
            nats_url=url,
        )
        started = time.monotonic()
        job = await stack.submit("node-1")
        done = await stack.wait_state(job.id, *FINISHED, JobState.FAILED, timeout_s=90)
    assert done.state in FINISHED, done.message
    assert stack.schedulers[0].events("node.lost") == []
    assert agent.events("agent.fenced") == []
    curve = await stack.curve(job.id)
    assert [p.step for p in curve.points] == list(range(1, 41))
    dropped = link.dropped() if relayed else None
    if relayed:
        assert dropped, "the loss rules dropped nothing: the link was not degraded"
    print(
        f"degraded link ({how}): done in {time.monotonic() - started:.1f} s, no node loss"
        + (f", {dropped} packets dropped" if dropped is not None else "")
    )
