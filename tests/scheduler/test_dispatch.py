"""The dispatcher with an in-memory recorder and fake agents: no bus.

The recorder fake keeps the real RecorderClient's compare-and-set loop
(`end_job`) and answers `transition` as the recorder does: applied only
from the job's current state, along the state machine."""

from __future__ import annotations

import asyncio

import msgspec
import pytest
import structlog

from lorafleet._recorder_client import RecorderClient
from lorafleet.errors import NotFoundError
from lorafleet.names import Names
from lorafleet.states import can_move, can_requeue
from lorafleet_schemas.messages import (
    ArtifactKind,
    CheckpointRef,
    Engine,
    Heartbeat,
    JobCancelRequest,
    JobListRequest,
    JobRecord,
    JobState,
    ModelRecord,
    NodeCancelReply,
    NodeCancelRequest,
    StartReply,
    StartRequest,
    TransitionReply,
    TransitionRequest,
)
from lorafleet_services.scheduler.dispatch import AgentRequests, Dispatcher
from lorafleet_services.scheduler.node_table import NodeTable
from tests.scheduler.test_logic import T0, hb, job


class MemoryRecorder(RecorderClient):
    def __init__(self, *jobs: JobRecord) -> None:
        super().__init__(None, Names(), 1.0, no_responders_retry_s=0.0)  # type: ignore[arg-type]
        self.jobs = {j.id: j for j in jobs}
        self.catalog = [
            ModelRecord(
                name="m",
                engine=Engine.VLLM,
                hf_repo=None,
                hf_revision="main",
                local_dir="/models/m",
                description="",
                created_at=T0,
            )
        ]

    async def get_job(self, job_id: str) -> JobRecord | None:
        return self.jobs.get(job_id)

    async def list_jobs(self, req: JobListRequest) -> list[JobRecord]:
        states = set(req.states or []) | ({req.state} if req.state else set())
        return [j for j in self.jobs.values() if j.state in states]

    async def models(self) -> list[ModelRecord]:
        return self.catalog

    async def transition(self, req: TransitionRequest) -> TransitionReply:
        current = self.jobs.get(req.id)
        if current is None:
            raise NotFoundError(f"no job {req.id}")
        message_only = req.from_state is req.to_state is JobState.QUEUED
        requeue = req.to_state is JobState.QUEUED and can_requeue(
            current.state, current.attempt, current.max_attempts
        )
        if current.state is not req.from_state or not (
            message_only or requeue or can_move(req.from_state, req.to_state)
        ):
            return TransitionReply(applied=False, job=current)
        moved = msgspec.structs.replace(
            current,
            state=req.to_state,
            message=req.message,
            node=current.requested_node if requeue else req.node or current.node,
            attempt=current.attempt + (req.to_state is JobState.STARTING),
        )
        self.jobs[req.id] = moved
        return TransitionReply(applied=True, job=moved)


class FakeAgents(AgentRequests):
    """Agents that answer starts with `reply` (an exception is raised)."""

    def __init__(self, reply: StartReply | BaseException = StartReply(accepted=True)) -> None:
        super().__init__(None, Names(), 1.0)  # type: ignore[arg-type]
        self.reply = reply
        self.starts: list[tuple[str, StartRequest]] = []
        self.cancels: list[tuple[str, NodeCancelRequest]] = []

    async def start(self, node: str, req: StartRequest) -> StartReply:
        self.starts.append((node, req))
        if isinstance(self.reply, BaseException):
            raise self.reply
        return self.reply

    async def cancel(self, node: str, req: NodeCancelRequest) -> NodeCancelReply:
        self.cancels.append((node, req))
        return NodeCancelReply(stopped=True)


def dispatcher(
    recorder: MemoryRecorder, agents: FakeAgents, table: NodeTable, now: float = 100.0
) -> Dispatcher:
    return Dispatcher(recorder, agents, table, lambda: now, structlog.get_logger())


async def settle(d: Dispatcher) -> None:
    """Let the requests the dispatcher sent off the round finish."""
    for _ in range(10):
        await asyncio.sleep(0)
    await d.stop()


def nodes(*beats: Heartbeat, now: float = 100.0) -> NodeTable:
    t = NodeTable()
    for b in beats:
        t.beat(b, now)
    return t


async def test_a_queued_job_moves_to_starting_then_its_start_goes_out() -> None:
    rec = MemoryRecorder(job("j1", node="a"))
    agents = FakeAgents()
    d = dispatcher(rec, agents, nodes(hb("a", cards=[(24000, 24000)])))
    await d.round(100.0, [])
    await settle(d)
    sent = rec.jobs["j1"]
    assert sent.state is JobState.STARTING and sent.node == "a" and sent.attempt == 1
    ((node, start),) = agents.starts
    assert node == "a" and start.job_id == "j1" and start.attempt == 1 and start.model.name == "m"


async def test_a_start_the_agent_refuses_fails_the_job_with_its_reason() -> None:
    rec = MemoryRecorder(job("j1", node="a"))
    agents = FakeAgents(StartReply(accepted=False, reason="busy with j0"))
    d = dispatcher(rec, agents, nodes(hb("a", cards=[(24000, 24000)])))
    await d.round(100.0, [])
    await settle(d)
    failed = rec.jobs["j1"]
    assert failed.state is JobState.FAILED
    assert failed.message == "the agent on a did not accept the job: busy with j0"


async def test_a_start_nobody_answers_leaves_the_job_starting() -> None:
    rec = MemoryRecorder(job("j1", node="a"))
    d = dispatcher(rec, FakeAgents(TimeoutError()), nodes(hb("a", cards=[(24000, 24000)])))
    await d.round(100.0, [])
    await settle(d)
    assert rec.jobs["j1"].state is JobState.STARTING


async def test_a_waiting_job_gets_its_reason_once() -> None:
    rec = MemoryRecorder(job("j1", node="b"))
    calls: list[TransitionRequest] = []
    transition = rec.transition

    async def counted(req: TransitionRequest) -> TransitionReply:
        calls.append(req)
        return await transition(req)

    rec.transition = counted  # type: ignore[method-assign]
    d = dispatcher(rec, FakeAgents(), nodes(hb("a", cards=[(24000, 24000)])))
    await d.round(100.0, [])
    await d.round(101.0, [])
    (req,) = calls
    assert req.from_state is req.to_state is JobState.QUEUED
    assert rec.jobs["j1"].message.startswith("waiting for node b: no agent of that name")


async def test_a_job_whose_model_left_the_catalog_fails() -> None:
    rec = MemoryRecorder(job("j1", node="a"))
    rec.catalog = []
    agents = FakeAgents()
    d = dispatcher(rec, agents, nodes(hb("a", cards=[(24000, 24000)])))
    await d.round(100.0, [])
    assert rec.jobs["j1"].state is JobState.FAILED and "no longer in the catalog" in (
        rec.jobs["j1"].message
    )
    assert agents.starts == []


async def test_the_jobs_of_a_lost_node_fail_naming_it() -> None:
    rec = MemoryRecorder(job("j1", node="a", state=JobState.RUNNING))
    table = nodes(hb("a", cards=[(24000, 24000)], job="j1"))
    lost = table.expire("a")
    assert lost is not None
    d = dispatcher(rec, FakeAgents(), table)
    await d.round(100.0, [lost])
    assert rec.jobs["j1"].state is JobState.FAILED
    assert rec.jobs["j1"].message.startswith("node a stopped heartbeating (last beat 12:00:00 UTC)")


async def test_reconcile_tells_a_node_to_stop_a_job_the_recorder_holds_final() -> None:
    rec = MemoryRecorder(job("j1", node="a", state=JobState.CANCELLED))
    agents = FakeAgents()
    d = dispatcher(rec, agents, nodes(hb("a", job="j1")))
    await d.round(100.0, [])
    await settle(d)
    ((node, req),) = agents.cancels
    assert node == "a" and req.job_id == "j1" and req.reason == "the job is cancelled"


async def test_cancel_a_queued_a_running_a_final_and_an_unknown_job() -> None:
    rec = MemoryRecorder(
        job("q", node="a"),
        job("r", node="a", state=JobState.RUNNING),
        job("d", node="a", state=JobState.DONE),
    )
    agents = FakeAgents()
    d = dispatcher(rec, agents, NodeTable())
    queued = await d.cancel(JobCancelRequest(id="q", reason="not needed"))
    assert queued.state is JobState.CANCELLED and queued.message == "cancelled: not needed"
    running = await d.cancel(JobCancelRequest(id="r"))
    assert running.state is JobState.CANCELLED and running.message == "cancelled on request"
    done = await d.cancel(JobCancelRequest(id="d"))
    assert done.state is JobState.DONE
    with pytest.raises(NotFoundError):
        await d.cancel(JobCancelRequest(id="nope"))
    await settle(d)
    # Only the job that was on its node is stopped there.
    assert [(n, r.job_id) for n, r in agents.cancels] == [("a", "r")]


# --- attempts ----------------------------------------------------------------


def ref(job_id: str, kind: ArtifactKind, step: int) -> CheckpointRef:
    return CheckpointRef(
        job_id=job_id, kind=kind, step=step, object=f"{job_id}/{kind}", size=1, sha256="0" * 64
    )


async def test_a_lost_nodes_job_with_attempts_left_is_requeued_and_resumes_elsewhere() -> None:
    cp = ref("j1", ArtifactKind.CHECKPOINT, 40)
    lost_job = msgspec.structs.replace(
        job("j1", node="a", state=JobState.RUNNING),
        attempt=1, max_attempts=2, step=47, checkpoint=cp,
    )  # fmt: skip
    rec = MemoryRecorder(lost_job)
    table = nodes(hb("a", cards=[(24000, 24000)], job="j1"), hb("b", cards=[(24000, 24000)]))
    lost = table.expire("a")
    assert lost is not None
    agents = FakeAgents()
    d = dispatcher(rec, agents, table)
    await d.round(100.0, [lost])
    back = rec.jobs["j1"]
    assert back.state is JobState.QUEUED and back.node is None
    assert back.message == (
        "node a was lost (last beat 12:00:00 UTC) at step 47; attempt 2 of 2 resumes from "
        "the checkpoint at step 40"
    )
    await d.round(101.0, [])
    await settle(d)
    ((node, start),) = agents.starts
    assert node == "b" and start.attempt == 2 and start.resume == cp
    assert rec.jobs["j1"].message == "sent to b, attempt 2 of 2"
    # The second loss is the last: it fails as it always did.
    table.expire("b")
    await d.round(102.0, [table.nodes["b"]])
    assert rec.jobs["j1"].state is JobState.FAILED
    assert rec.jobs["j1"].message.startswith("node b stopped heartbeating")


async def test_a_start_the_last_leader_never_sent_is_sent_again_with_the_same_attempt() -> None:
    stuck = msgspec.structs.replace(job("j1", node="a", state=JobState.STARTING), attempt=1)
    rec = MemoryRecorder(stuck)
    clock = [100.0]
    table = nodes(hb("a", cards=[(24000, 24000)]))
    agents = FakeAgents()
    d = Dispatcher(rec, agents, table, lambda: clock[0], structlog.get_logger())
    await d.round(100.0, [])
    table.beat(hb("a", cards=[(24000, 24000)]), 103.0)
    clock[0] = 103.0
    await d.round(103.0, [])
    await settle(d)
    ((node, start),) = agents.starts
    assert node == "a" and start.job_id == "j1" and start.attempt == 1
    assert rec.jobs["j1"].state is JobState.STARTING and rec.jobs["j1"].attempt == 1
    # Sent again and still not run: lost now (max_attempts 1: failed).
    table.beat(hb("a", cards=[(24000, 24000)]), 106.0)
    await d.round(106.0, [])
    assert rec.jobs["j1"].state is JobState.FAILED and "never received it" in rec.jobs["j1"].message


async def test_a_refused_start_sent_again_is_a_loss_requeued_with_attempts_left() -> None:
    stuck = msgspec.structs.replace(
        job("j1", node="a", state=JobState.STARTING), attempt=1, max_attempts=2, requested_node="a"
    )
    rec = MemoryRecorder(stuck)
    table = nodes(hb("a", cards=[(24000, 24000)]))
    agents = FakeAgents(StartReply(accepted=False, reason="attempt 1 of j1 already ran here"))
    d = dispatcher(rec, agents, table)
    await d.round(100.0, [])
    table.beat(hb("a", cards=[(24000, 24000)]), 103.0)
    await d.round(103.0, [])
    await settle(d)
    back = rec.jobs["j1"]
    assert back.state is JobState.QUEUED and back.node == "a"
    assert back.message.startswith(
        "the agent on a refused the start sent again at step 0; attempt 2 of 2"
    )


async def test_a_job_resumed_from_another_starts_from_its_checkpoint_or_adapter() -> None:
    peft = ref("o", ArtifactKind.PEFT, 0)
    other = msgspec.structs.replace(job("o", state=JobState.DONE), adapter=peft)
    mine = msgspec.structs.replace(job("j1", node="a"), resume_from="o")
    gone = msgspec.structs.replace(job("j2", node="b"), resume_from="x")
    orphan = job("x", state=JobState.FAILED)
    rec = MemoryRecorder(other, mine, gone, orphan)
    agents = FakeAgents()
    d = dispatcher(
        rec, agents, nodes(hb("a", cards=[(24000, 24000)]), hb("b", cards=[(24000, 24000)]))
    )
    await d.round(100.0, [])
    await settle(d)
    ((node, start),) = agents.starts
    assert node == "a" and start.resume == peft
    assert rec.jobs["j2"].state is JobState.FAILED
    assert "job x (resume_from) has no checkpoint or adapter" in rec.jobs["j2"].message


async def test_a_start_to_send_again_whose_model_left_the_catalog_fails() -> None:
    stuck = msgspec.structs.replace(job("j1", node="a", state=JobState.STARTING), attempt=1)
    rec = MemoryRecorder(stuck)
    rec.catalog = []
    table = nodes(hb("a", cards=[(24000, 24000)]))
    agents = FakeAgents()
    d = dispatcher(rec, agents, table)
    await d.round(100.0, [])
    table.beat(hb("a", cards=[(24000, 24000)]), 103.0)
    await d.round(103.0, [])
    await settle(d)
    assert agents.starts == [] and rec.jobs["j1"].state is JobState.FAILED
    assert "no longer in the catalog" in rec.jobs["j1"].message
