"""The dispatcher with an in-memory recorder and fake agents: no bus.

The recorder fake keeps the real RecorderClient's compare-and-set loop
(`end_job`) and answers `transition` as the recorder does: applied only
from the job's current state, along the state machine."""

from __future__ import annotations

import asyncio

import msgspec
import nats.errors
import pytest
import structlog

from lorafleet._recorder_client import RecorderClient
from lorafleet.errors import NotFoundError, UnavailableError
from lorafleet.names import Names
from lorafleet.states import ON_NODE, can_move, can_requeue
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
    NodeCheckpointReply,
    NodeCheckpointRequest,
    NodeSchedule,
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
        requeue = req.to_state is JobState.QUEUED and (
            (req.moved and current.state in ON_NODE)
            or can_requeue(current.state, current.attempt, current.max_attempts)
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
            max_attempts=current.max_attempts + (requeue and req.moved),
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
        self.checkpoints: list[tuple[str, NodeCheckpointRequest]] = []
        #: How a checkpoint ask is answered: by default the node cannot take
        #: it (a trainer that has not started), and the job moves at once.
        self.checkpoint_reply = NodeCheckpointReply(asked=False, reason="not started")

    async def start(self, node: str, req: StartRequest) -> StartReply:
        self.starts.append((node, req))
        if isinstance(self.reply, BaseException):
            raise self.reply
        return self.reply

    async def cancel(self, node: str, req: NodeCancelRequest) -> NodeCancelReply:
        self.cancels.append((node, req))
        return NodeCancelReply(stopped=True)

    async def checkpoint(self, node: str, req: NodeCheckpointRequest) -> NodeCheckpointReply:
        self.checkpoints.append((node, req))
        return self.checkpoint_reply


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


async def test_a_start_an_agent_presumed_lost_will_not_take_is_a_loss_not_a_failure() -> None:
    """Seed 16: an agent frozen past its fence answers unavailable; the job is
    requeued with attempts left (not failed: nothing was wrong with it)."""
    rec = MemoryRecorder(msgspec.structs.replace(job("j1", node="a"), max_attempts=2))
    said = UnavailableError("a is presumed lost (no heartbeat acknowledged ...)")
    d = dispatcher(rec, FakeAgents(said), nodes(hb("a", cards=[(24000, 24000)])))
    await d.round(100.0, [])
    await settle(d)
    back = rec.jobs["j1"]
    assert back.state is JobState.QUEUED, back
    assert back.message.startswith("the agent on a is presumed lost"), back.message


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


class SlowStoppingAgents(FakeAgents):
    """Agents whose cancel is answered once `answer` is set: the node stopping
    its trainer (or, with `fail`, the request failing: nobody there)."""

    def __init__(self, fail: BaseException | None = None) -> None:
        super().__init__()
        self.answer = asyncio.Event()
        self.fail = fail

    async def cancel(self, node: str, req: NodeCancelRequest) -> NodeCancelReply:
        self.cancels.append((node, req))
        await self.answer.wait()
        if self.fail is not None:
            raise self.fail
        return NodeCancelReply(stopped=True)


@pytest.mark.parametrize("fail", [None, nats.errors.NoRespondersError()])
async def test_a_lost_nodes_job_runs_elsewhere_only_once_that_node_was_told_to_stop_it(
    fail: BaseException | None,
) -> None:
    """Issue 33: attempt 1 went on reporting on a node judged lost after
    attempt 2 began elsewhere. The lost node is told to stop the job, which
    is held from dispatch until the node answered (or could not: no agent)."""
    lost_job = msgspec.structs.replace(
        job("j1", node="a", state=JobState.RUNNING), attempt=1, max_attempts=2
    )
    rec = MemoryRecorder(lost_job)
    table = nodes(hb("a", cards=[(24000, 24000)], job="j1"), hb("b", cards=[(24000, 24000)]))
    lost = table.expire("a")
    assert lost is not None
    agents = SlowStoppingAgents(fail)
    d = dispatcher(rec, agents, table)
    await d.round(100.0, [lost])
    await d.round(101.0, [])
    for _ in range(10):
        await asyncio.sleep(0)
    assert rec.jobs["j1"].state is JobState.QUEUED
    assert agents.starts == [], "sent elsewhere while the lost node may still run it"
    [(node, req)] = agents.cancels
    assert node == "a" and req.job_id == "j1" and "node a was lost" in (req.reason or "")
    agents.answer.set()
    for _ in range(10):
        await asyncio.sleep(0)
    await d.round(102.0, [])
    await settle(d)
    [(node, start)] = agents.starts
    assert node == "b" and start.attempt == 2


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


async def test_a_drained_nodes_training_moves_elsewhere_once_the_node_stopped_it() -> None:
    """drain --move-training: the job (on its last attempt) is requeued, a
    new attempt that uses none of its own; the node is told to stop it and
    the job is held until it answered, as a lost node's job is; then it
    resumes from its checkpoint on another node, never the drained one."""
    cp = ref("j1", ArtifactKind.CHECKPOINT, 40)
    running = msgspec.structs.replace(
        job("j1", node="a", state=JobState.RUNNING), attempt=1, step=47, checkpoint=cp
    )
    rec = MemoryRecorder(running)
    table = nodes(hb("a", cards=[(80000, 80000)], job="j1"), hb("b", cards=[(24000, 24000)]))
    table.mark("a", NodeSchedule.DRAINED, move_training=True)
    agents = SlowStoppingAgents()
    d = dispatcher(rec, agents, table)
    await d.round(100.0, [])
    moved = rec.jobs["j1"]
    assert moved.state is JobState.QUEUED and moved.node is None and moved.max_attempts == 2
    assert moved.message == (
        "node a was drained with move_training at step 47; attempt 2 of 2 resumes from the "
        "checkpoint at step 40 on another node (the move uses none of its attempts)"
    )
    await d.round(101.0, [])
    for _ in range(10):
        await asyncio.sleep(0)
    assert agents.starts == [], "sent elsewhere while the drained node still runs it"
    # Reconcile too tells a node that runs a job queued again to stop it.
    assert {(node, req.job_id) for node, req in agents.cancels} == {("a", "j1")}
    assert "drained" in (agents.cancels[0][1].reason or "")
    agents.answer.set()
    for _ in range(10):
        await asyncio.sleep(0)
    # The drained node beats idle now, with more free memory than b: still not chosen.
    table.beat(hb("a", cards=[(80000, 80000)]), 102.0)
    await d.round(102.0, [])
    await settle(d)
    [(node, start)] = agents.starts
    assert node == "b" and start.attempt == 2 and start.resume == cp


async def test_a_drained_nodes_job_moves_once_the_checkpoint_it_was_asked_for_is_stored() -> None:
    """The node is asked for a checkpoint after the trainer's next step; the
    job stays until the recorder holds one at least that new, then resumes
    from it: the steps since the scheduled checkpoint (40 -> 47) are kept."""
    running = msgspec.structs.replace(
        job("j1", node="a", state=JobState.RUNNING), attempt=1, step=47,
        checkpoint=ref("j1", ArtifactKind.CHECKPOINT, 40),
    )  # fmt: skip
    rec = MemoryRecorder(running)
    table = nodes(hb("a", cards=[(80000, 80000)], job="j1"), hb("b", cards=[(24000, 24000)]))
    table.mark("a", NodeSchedule.DRAINED, move_training=True)
    agents = FakeAgents()
    agents.checkpoint_reply = NodeCheckpointReply(asked=True)
    d = dispatcher(rec, agents, table)
    await d.round(100.0, [])
    await d.round(101.0, [])
    assert rec.jobs["j1"].state is JobState.RUNNING and agents.cancels == []
    assert [(n, r.job_id, r.attempt) for n, r in agents.checkpoints] == [("a", "j1", 1)]
    taken = ref("j1", ArtifactKind.CHECKPOINT, 48)
    rec.jobs["j1"] = msgspec.structs.replace(rec.jobs["j1"], step=48, checkpoint=taken)
    await d.round(102.0, [])
    await settle(d)
    moved = rec.jobs["j1"]
    assert moved.state is JobState.QUEUED and "resumes from the checkpoint at step 48" in (
        moved.message
    ), moved.message
    assert len(agents.checkpoints) == 1


async def test_a_cordoned_or_plainly_drained_nodes_job_is_left_running() -> None:
    """Cordon (and drain without move_training): the job there trains on
    there, untouched; nothing new goes to the node, even once it is idle and
    the only node there is."""
    for schedule in (NodeSchedule.CORDONED, NodeSchedule.DRAINED):
        # With a checkpoint: movable, were it asked.
        running = msgspec.structs.replace(
            job("j1", node="a", state=JobState.RUNNING),
            attempt=1, step=5, checkpoint=ref("j1", ArtifactKind.CHECKPOINT, 4),
        )  # fmt: skip
        rec = MemoryRecorder(running, job("j2"))
        table = nodes(hb("a", cards=[(24000, 24000)], job="j1"))
        table.mark("a", schedule)
        agents = FakeAgents()
        d = dispatcher(rec, agents, table)
        for now in (100.0, 101.0, 102.0):
            await d.round(now, [])
        for _ in range(10):
            await asyncio.sleep(0)
        assert rec.jobs["j1"] == running and agents.cancels == [] and agents.starts == []
        # j1 ends there; the idle node still takes nothing new.
        rec.jobs["j1"] = msgspec.structs.replace(running, state=JobState.DONE)
        table.beat(hb("a", cards=[(24000, 24000)]), 103.0)
        await d.round(103.0, [])
        await settle(d)
        assert agents.starts == [] and rec.jobs["j2"].state is JobState.QUEUED
        assert "cordoned" in rec.jobs["j2"].message, rec.jobs["j2"].message
