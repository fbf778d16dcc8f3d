"""Cordon and drain with a training job on the node (issue 29), through the
real recorder, scheduler, artifact-store and agents with the stand-in
trainer: a cordoned node's job trains on there while nothing new is sent
there; `drain` with move_training has the job checkpoint at the move, stops
it there and resumes it on another node from that checkpoint, a new attempt
that uses none of its own; without a checkpoint the drain refuses to move
it (unless forced), changing nothing."""

from __future__ import annotations

import re
from typing import Any

import pytest

from lorafleet.errors import ConflictError
from lorafleet_schemas.messages import JobState, NodeSchedule
from tests.eventually import eventually
from tests.system.conftest import Stack
from tests.system.test_resume import EVERY_STEPS, STEP_S

FINISHED = (JobState.DONE, JobState.FAILED, JobState.CANCELLED)


async def schedule(stack: Stack, node: str, schedule: NodeSchedule, **more: bool) -> Any:
    """`api.nodes.schedule`, as JSON (its answer's `moving` and `staying` included)."""
    body = {"node": node, "schedule": schedule.value, **more}
    return await stack.call(stack.settings.names.nodes_schedule, body)


async def test_a_cordoned_nodes_job_trains_on_there_and_nothing_new_goes_there(
    stack: Stack,
) -> None:
    await stack.add_model()
    await stack.agent("node-1", env={"LORAFLEET_STANDIN_STEP_S": STEP_S})
    job = await stack.submit(None, params={"max_steps": 60})
    await eventually(lambda: stack.get(job.id), "the job training", until=lambda j: j.step >= 5)
    # No checkpoint yet: moving it would lose its steps, so the drain is refused.
    with pytest.raises(ConflictError, match=f"nothing changed: node node-1 runs job {job.id}"):
        await schedule(stack, "node-1", NodeSchedule.DRAINED, move_training=True)
    assert [n.schedule for n in (await stack.nodes()).nodes] == [NodeSchedule.OPEN]
    marked = await schedule(stack, "node-1", NodeSchedule.CORDONED)
    assert marked["schedule"] == "cordoned" and marked["moving"] == [], marked
    waiting = await stack.submit(None)
    done = await stack.wait_state(job.id, *FINISHED, timeout_s=60)
    assert done.state is JobState.DONE and done.node == "node-1" and done.attempt == 1
    # The node is idle now and the only one: the next job still waits.
    await eventually(
        lambda: stack.get(waiting.id), "the next job waiting, saying why",
        until=lambda j: j.state is JobState.QUEUED and "cordoned" in j.message,
    )  # fmt: skip
    await schedule(stack, "node-1", NodeSchedule.OPEN)
    assert (await stack.wait_state(waiting.id, JobState.DONE)).node == "node-1"


async def test_drain_with_move_training_resumes_the_job_elsewhere_from_its_checkpoint(
    stack: Stack,
) -> None:
    await stack.add_model()
    env = {"LORAFLEET_STANDIN_STEP_S": STEP_S}
    await stack.agent("node-1", env=env)
    await stack.agent("node-2", env=env)
    # No scheduled checkpoint: the one the job resumes from is taken at the move.
    params = {"max_steps": 80, "checkpoint_every_steps": 0, "checkpoint_every_s": 0}
    job = await stack.submit(None, params=params)  # max_attempts 1: its only attempt
    past = await eventually(
        lambda: stack.get(job.id), "the job training", until=lambda j: j.step >= EVERY_STEPS
    )
    first = past.node
    assert first is not None and past.checkpoint is None
    other = "node-2" if first == "node-1" else "node-1"
    # force: it has no checkpoint yet (without, the drain is refused: the test above).
    marked = await schedule(stack, first, NodeSchedule.DRAINED, move_training=True, force=True)
    assert marked["moving"] == [job.id] and marked["move_training"], marked

    done = await stack.wait_state(job.id, *FINISHED, timeout_s=60)
    assert done.state is JobState.DONE, done.message
    assert done.node == other and done.attempt == 2 and done.max_attempts == 2
    curve = await stack.curve(job.id)
    assert [p.step for p in curve.points] == list(range(1, 81))
    resumed = min(p.step for p in curve.points if p.attempt == 2) - 1
    # A checkpoint taken at the move: none of the steps before the drain is lost.
    assert resumed >= past.step, (resumed, past.step)
    [requeue] = [e for e in curve.events if e.to_state is JobState.QUEUED and e.from_state]
    assert requeue.message.startswith(f"node {first} was drained with move_training at step ")
    said = re.search(r"attempt 2 of 2 resumes from the checkpoint at step (\d+)", requeue.message)
    assert said is not None and past.step <= int(said[1]) <= resumed, requeue.message
    nodes = {n.heartbeat.node: n for n in (await stack.nodes()).nodes}
    assert nodes[first].schedule is NodeSchedule.DRAINED and nodes[first].move_training
