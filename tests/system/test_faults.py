"""Failures of real processes: agents killed or restarted, nats-server restarted,
cancels, schedulers killed or racing, a job no card can hold."""

from __future__ import annotations

import asyncio
import time

import pytest

from lorafleet.errors import NotFoundError
from lorafleet_schemas.messages import JobState
from tests.eventually import eventually
from tests.procs import ServiceProcess
from tests.system.conftest import (
    Stack,
    has_artifact_store,
    kill_pid,
    pid_alive,
    start_requests,
    trainer_pids,
)

FINISHED = (JobState.DONE,) if has_artifact_store() else (JobState.DONE, JobState.UPLOADING)
SLOW = {"LORAFLEET_STANDIN_STEPS": "200", "LORAFLEET_STANDIN_STEP_S": "0.1"}


async def test_agent_killed_mid_job_fails_the_job_naming_the_node(stack: Stack) -> None:
    await stack.add_model()
    agent = await stack.agent("node-1", env=SLOW)
    job = await stack.submit("node-1")
    await stack.wait_state(job.id, JobState.RUNNING)
    pids = trainer_pids(agent)
    try:
        agent.kill()
        killed_at = time.monotonic()
        failed = await stack.wait_state(job.id, JobState.FAILED, timeout_s=15)
        took_s = time.monotonic() - killed_at
    finally:
        for pid in pids:
            kill_pid(pid)
    assert "node node-1 stopped heartbeating" in failed.message
    assert "last beat" in failed.message
    assert took_s <= stack.settings.node_timeout_s + 2.0, took_s
    assert await stack.active_jobs() == []


async def test_nats_server_restart_mid_job_and_the_job_completes(stack: Stack) -> None:
    await stack.add_model()
    # 60 steps of 0.1 s: the job outlives the node timeout after the restart,
    # so a scheduler that lost sight of the node's beats would fail it.
    agent = await stack.agent(
        "node-1", env={"LORAFLEET_STANDIN_STEPS": "60", "LORAFLEET_STANDIN_STEP_S": "0.1"}
    )
    job = await stack.submit("node-1")
    await stack.wait_state(job.id, JobState.RUNNING)
    await stack.nats_server.restart()
    done = await stack.wait_state(job.id, *FINISHED, JobState.FAILED, timeout_s=40)
    assert done.state in FINISHED, done.message
    assert done.step == 60
    assert done.attempt == 1
    # The services still dispatch after the restart.
    nxt = await stack.submit("node-1")
    again = await stack.wait_state(nxt.id, *FINISHED, JobState.FAILED)
    assert again.state in FINISHED, again.message
    assert start_requests(agent) == [job.id, nxt.id]


async def test_cancel_a_queued_job_and_a_running_one(stack: Stack) -> None:
    await stack.add_model()
    agent = await stack.agent("node-1", env={**SLOW, "LORAFLEET_STANDIN_CHILD": "1"})
    running = await stack.submit("node-1")
    queued = await stack.submit("node-1")
    await stack.wait_state(running.id, JobState.RUNNING)

    cancelled = await stack.cancel(queued.id, reason="changed my mind")
    assert cancelled.state is JobState.CANCELLED
    assert "changed my mind" in cancelled.message

    await eventually(lambda: _has_pids(agent, 2), "the stand-in's pids in the agent log")
    pids = trainer_pids(agent)
    assert len(pids) == 2  # the trainer and its child
    stopped = await stack.cancel(running.id)
    assert stopped.state is JobState.CANCELLED

    async def all_gone() -> bool:
        return not any(pid_alive(p) for p in pids)

    await eventually(all_gone, f"trainer processes {pids} to end", timeout_s=15)

    async def node_idle() -> bool:
        nodes = (await stack.nodes()).nodes
        return any(n.heartbeat.node == "node-1" and n.heartbeat.job is None for n in nodes)

    await eventually(node_idle, "node-1 to heartbeat with no job")
    # The node is idle now: the cancelled queued job must still never be sent.
    await asyncio.sleep(1.5)
    assert start_requests(agent) == [running.id]
    assert (await stack.get(queued.id)).state is JobState.CANCELLED
    assert (await stack.get(running.id)).state is JobState.CANCELLED
    # Cancelling a final job returns it unchanged; an unknown id is not found.
    again = await stack.cancel(running.id)
    assert again.state is JobState.CANCELLED and again.updated_at == stopped.updated_at
    with pytest.raises(NotFoundError, match="no job has id") as err:
        await stack.cancel("no-such-job")
    assert err.value.code == "not_found"


async def _has_pids(agent: ServiceProcess, n: int) -> bool:
    return len(trainer_pids(agent)) >= n


async def test_scheduler_killed_and_restarted_mid_flow(stack: Stack) -> None:
    await stack.add_model()
    agent = await stack.agent(
        "node-1", env={"LORAFLEET_STANDIN_STEPS": "10", "LORAFLEET_STANDIN_STEP_S": "0.1"}
    )
    jobs = [await stack.submit("node-1") for _ in range(3)]
    await stack.wait_state(jobs[0].id, JobState.RUNNING)
    stack.schedulers[0].kill()
    await asyncio.sleep(1.0)
    await stack.scheduler()
    for job in jobs:
        done = await stack.wait_state(job.id, *FINISHED, JobState.FAILED, timeout_s=40)
        assert done.state in FINISHED, done.message
        assert done.attempt == 1
    assert sorted(start_requests(agent)) == sorted(j.id for j in jobs)


async def test_two_schedulers_race_and_every_job_is_dispatched_once(stack: Stack) -> None:
    await stack.add_model()
    await stack.scheduler()
    fast = {"LORAFLEET_STANDIN_STEPS": "4", "LORAFLEET_STANDIN_STEP_S": "0.05"}
    agents = [await stack.agent(n, env=fast) for n in ("node-1", "node-2")]
    jobs = [await stack.submit(None) for _ in range(3)]
    jobs += [await stack.submit(n) for n in ("node-1", "node-2", "node-1", "node-2")]
    # Kill the leader mid-flow: the other takes over.
    leader = next(s for s in stack.schedulers if s.events("leader.acquired"))
    await stack.wait_state(jobs[0].id, JobState.RUNNING, *FINISHED)
    leader.kill()
    for job in jobs:
        done = await stack.wait_state(job.id, *FINISHED, JobState.FAILED, timeout_s=60)
        assert done.state in FINISHED, done.message
        assert done.attempt == 1
    sent = [j for a in agents for j in start_requests(a)]
    assert sorted(sent) == sorted(j.id for j in jobs)  # each exactly once
    survivor = next(s for s in stack.schedulers if s is not leader)
    assert survivor.events("leader.acquired")


async def test_a_job_larger_than_any_card_stays_queued_saying_so(stack: Stack) -> None:
    await stack.add_model()
    stop = asyncio.Event()
    beats = asyncio.create_task(stack.fake_node("gpu-1", [(24000, 23000), (16000, 16000)], stop))
    try:

        async def node_seen() -> bool:
            return any(n.heartbeat.node == "gpu-1" for n in (await stack.nodes()).nodes)

        await eventually(node_seen, "gpu-1 in nodes.list")
        job = await stack.submit("gpu-1", mib=30000)

        async def says_so() -> bool:
            return "no card on gpu-1 has 30000 MiB" in (await stack.get(job.id)).message

        await eventually(says_so, "the waiting message", timeout_s=10)
        await asyncio.sleep(1.5)
        still = await stack.get(job.id)
        assert still.state is JobState.QUEUED
        assert "GPU 0" in still.message and "24000 MiB" in still.message
    finally:
        stop.set()
        await beats


async def test_a_node_running_a_job_the_recorder_holds_final_is_told_to_stop(
    stack: Stack,
) -> None:
    await stack.add_model()
    agent = await stack.agent("node-1", env=SLOW)
    job = await stack.submit("node-1")
    running = await stack.wait_state(job.id, JobState.RUNNING)
    await eventually(lambda: _has_pids(agent, 1), "the trainer's pid in the agent log")
    pids = trainer_pids(agent)
    # Behind the scheduler's back (an operator, a lost race): the recorder ends the job.
    reply = await stack.call(
        stack.settings.names.store_transition,
        {"id": job.id, "from_state": running.state.value, "to_state": "failed",
         "message": "failed by hand"},
    )  # fmt: skip
    assert reply["applied"] is True

    async def all_gone() -> bool:
        return not any(pid_alive(p) for p in pids)

    await eventually(all_gone, f"trainer processes {pids} to end", timeout_s=15)

    async def told() -> bool:
        # Logged once the agent has answered, which is after the trainer ended.
        return any(
            ln.get("job_id") == job.id and "told the node to stop" in str(ln.get("message"))
            for s in stack.schedulers
            for ln in s.events("job.cancelled")
        )

    await eventually(told, "the scheduler's job.cancelled line", timeout_s=10)


async def test_a_job_for_an_unknown_node_waits_saying_which(stack: Stack) -> None:
    await stack.add_model()
    job = await stack.submit("ghost-9")

    async def says_so() -> bool:
        return "waiting for node ghost-9" in (await stack.get(job.id)).message

    await eventually(says_so, "the waiting message", timeout_s=10)
    assert (await stack.get(job.id)).state is JobState.QUEUED
