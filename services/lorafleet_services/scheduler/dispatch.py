"""Jobs onto and off nodes: the leader's dispatch round, and cancel.

One round (`Dispatcher.round`, the leader's, one at a time): fail the jobs
of nodes lost since the last round, move the training of nodes drained
with move_training (`move_off_node`), plan and send queued jobs
(`placement.plan_dispatch`), say why the others wait, and every
`RECONCILE_EVERY_S` compare what the recorder holds on nodes with what the
nodes run (`reconcile.reconcile`). Every decision is in node_table.py,
placement.py and reconcile.py; this module applies them through the
recorder's compare-and-set (queued -> starting *before* the start goes
out, so two schedulers cannot both send it) and sends the requests to
agents off the round, so that a silent agent holds up nobody else.
`cancel` is any replica's. What a refused or unanswered start does:
scheduler/DESIGN.md.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable, Coroutine
from typing import Any

import nats.errors
from nats.aio.client import Client

from lorafleet import metrics
from lorafleet._recorder_client import RecorderClient
from lorafleet._tasks import stop_tasks
from lorafleet.errors import (
    ApiError,
    BadRequestError,
    ConflictError,
    NotFoundError,
    UnavailableError,
)
from lorafleet.fleet_serving import policy_of
from lorafleet.log import Event
from lorafleet.names import Names
from lorafleet.nats import _bus as bus
from lorafleet.states import FINAL, ON_NODE
from lorafleet_schemas.messages import (
    LIST_MAX,
    CheckpointRef,
    JobCancelRequest,
    JobListRequest,
    JobRecord,
    JobState,
    ModelRecord,
    NodeCancelReply,
    NodeCancelRequest,
    NodeCheckpointReply,
    NodeCheckpointRequest,
    NodeServeReply,
    NodeServeRequest,
    NodeUnserveRequest,
    StartReply,
    StartRequest,
    TransitionRequest,
)
from lorafleet_services.scheduler import placement, reconcile
from lorafleet_services.scheduler.move_checkpoints import MoveCheckpoints
from lorafleet_services.scheduler.node_table import Node, NodeTable

#: Seconds between reconcile passes (each asks the recorder about jobs nodes
#: run that it does not hold active); default 1.
RECONCILE_EVERY_S = 1.0
#: Seconds a node cancel waits at least for its answer: the agent answers
#: once its trainer has stopped, which takes a moment.
NODE_CANCEL_TIMEOUT_S = 15.0


class AgentRequests:
    """The requests the scheduler sends an agent (tests put a fake here).

    timeout_s: seconds a start request waits for its answer.
    """

    def __init__(self, nc: Client, names: Names, timeout_s: float) -> None:
        self.nc = nc
        self.names = names
        self.timeout_s = timeout_s

    async def start(self, node: str, req: StartRequest) -> StartReply:
        return await bus.request(
            self.nc, self.names.node_start(node), req, StartReply, timeout_s=self.timeout_s
        )

    async def cancel(self, node: str, req: NodeCancelRequest) -> NodeCancelReply:
        return await bus.request(
            self.nc,
            self.names.node_cancel(node),
            req,
            NodeCancelReply,
            timeout_s=max(self.timeout_s, NODE_CANCEL_TIMEOUT_S),
        )

    async def serve(self, node: str, req: NodeServeRequest) -> NodeServeReply:
        """The agent answers what it took on at once; the loads follow as reports."""
        return await bus.request(
            self.nc, self.names.node_serve(node), req, NodeServeReply, timeout_s=self.timeout_s
        )

    async def checkpoint(self, node: str, req: NodeCheckpointRequest) -> NodeCheckpointReply:
        return await bus.request(
            self.nc, self.names.node_checkpoint(node), req, NodeCheckpointReply,
            timeout_s=self.timeout_s,
        )  # fmt: skip

    async def unserve(self, node: str, req: NodeUnserveRequest) -> NodeServeReply:
        return await bus.request(
            self.nc, self.names.node_unserve(node), req, NodeServeReply, timeout_s=self.timeout_s
        )


class WaitingMessages:
    """What each queued job waits for, said once per change: logged, and set
    as the job's message by the recorder's `queued -> queued`."""

    def __init__(self, recorder: RecorderClient, logger: Any) -> None:
        self.recorder = recorder
        self.logger = logger
        self.said: dict[str, str] = {}
        #: False once the recorder refused a message-only transition (an older one).
        self.updates = True

    async def say(self, job: JobRecord, message: str) -> None:
        """Tell the recorder (and the log) what `job` waits for, once per message."""
        if self.said.get(job.id) == message:
            return
        self.said[job.id] = message
        if len(self.said) > 10 * LIST_MAX:
            self.said.clear()
        self.logger.info(Event.JOB_WAITING, job_id=job.id, node=job.node, message=message)
        if job.message == message or not self.updates:
            return
        # A queued -> queued "transition" only sets the message (the recorder
        # records no event for it); older recorders refuse it.
        try:
            await self.recorder.transition(
                TransitionRequest(
                    id=job.id, from_state=JobState.QUEUED, to_state=JobState.QUEUED, message=message
                )
            )
        except (BadRequestError, ConflictError) as e:
            self.updates = False
            self.logger.warning(
                Event.TRANSITION_REFUSED,
                job_id=job.id,
                message="the recorder cannot set a queued job's message; "
                "waiting reasons are only logged",
                error=str(e),
            )


class Dispatcher:
    """Moves jobs between the queue and the nodes of `table`.

    clock: monotonic seconds (the grace of reconcile runs on it).
    """

    def __init__(
        self,
        recorder: RecorderClient,
        agents: AgentRequests,
        table: NodeTable,
        clock: Callable[[], float],
        logger: Any,
        store_wait_s: float = math.inf,
    ) -> None:
        self.recorder = recorder
        self.store_wait_s = store_wait_s
        self.agents = agents
        self.table = table
        self.clock = clock
        self.logger = logger
        #: job id -> monotonic seconds when this scheduler sent it or first saw it on its node.
        self.first_seen: dict[str, float] = {}
        #: The jobs whose start this scheduler sent (or sent again).
        self.sent: set[str] = set()
        #: job id -> when the agent took the job (its start reply).
        self.taken: dict[str, reconcile.Taken] = {}
        #: job id -> monotonic seconds when this scheduler first saw it delivered.
        self.delivered_at: dict[str, float] = {}
        self._last_reconcile = 0.0
        self._model_cache: dict[str, ModelRecord] = {}
        self.waiting = WaitingMessages(recorder, logger)
        self._background: set[asyncio.Task[Any]] = set()
        #: Jobs lost with a node -> the request telling that node to stop them:
        #: held from dispatch until it is answered or fails (`_stop_and_hold`);
        #: the jobs moved off a drained node too.
        self.held: dict[str, asyncio.Task[None]] = {}
        self.move_checkpoints = MoveCheckpoints(agents, logger)

    async def stop(self) -> None:
        """Drop pending start and node-cancel requests: what they would have
        done, reconcile does for the next leader."""
        await stop_tasks(*self._background)

    def _spawn(self, coro: Coroutine[Any, Any, Any]) -> asyncio.Task[Any]:
        task = asyncio.create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        return task

    async def fail_on_node(self, job: JobRecord, message: str) -> bool:
        """Fail `job` from whatever active state it is in, while it is still on its node."""
        ended = await self.recorder.fail_job(job, message, still=lambda j: j.node == job.node)
        if ended.applied:
            self.logger.warning(
                Event.JOB_LOST,
                job_id=job.id,
                node=job.node,
                state=ended.from_state.value if ended.from_state else "",
                message=message,
            )
        return ended.applied

    async def lose_on_node(self, job: JobRecord, cause: str, message: str) -> bool:
        """`job` was lost on its node by no fault of its own: requeue it with
        attempts left (saying `cause`), else fail it with `message`."""
        ended = await self.recorder.lose_job(
            job, cause, message, still=lambda j: j.node == job.node
        )
        if ended.applied and ended.job is not None:
            requeued = ended.job.state is JobState.QUEUED
            self.logger.warning(
                Event.JOB_REQUEUED if requeued else Event.JOB_LOST,
                job_id=job.id,
                node=job.node,
                state=ended.from_state.value if ended.from_state else "",
                attempt=job.attempt,
                message=ended.job.message,
            )
            self.sent.discard(job.id)
        return ended.applied

    # --- the round ------------------------------------------------------

    async def round(self, now: float, lost: list[Node]) -> None:
        """One pass: fail `lost` nodes' jobs, dispatch queued jobs, reconcile.
        Only call it once the node table is complete."""
        # Both lists at once: the round's latency is mostly these round trips.
        on_node, queued = await asyncio.gather(
            self.recorder.list_jobs(JobListRequest(states=sorted(ON_NODE), limit=LIST_MAX)),
            self.recorder.list_jobs(
                JobListRequest(state=JobState.QUEUED, oldest_first=True, limit=LIST_MAX)
            ),
        )
        failed: set[str] = set()
        for node in lost:
            for job in reconcile.jobs_lost_with(node, on_node, self.first_seen):
                cause = reconcile.node_lost_cause(node)
                if await self.lose_on_node(job, cause, reconcile.node_lost_message(node)):
                    failed.add(job.id)
                    self._stop_and_hold(node.name, job.id, cause)
        moves = reconcile.training_moves(on_node, self.table.nodes, self.table.moves)
        for job in await self.move_checkpoints.ready(moves, now, skip=failed):
            if await self.move_off_node(job):
                failed.add(job.id)
        held = self._holding()
        queued = [j for j in queued if j.id not in held]
        if queued:
            await self._dispatch_queued(queued, on_node, now)
        if now - self._last_reconcile >= RECONCILE_EVERY_S:
            self._last_reconcile = now
            await self._reconcile([j for j in on_node if j.id not in failed], now)

    async def move_off_node(self, job: JobRecord) -> bool:
        """Move `job` off its node, drained with move_training: requeued (a new
        attempt that uses none of its own), then stopped and held as a lost
        node's job is (`_stop_and_hold`); dispatch sends it elsewhere."""
        node = job.node or ""  # training_moves picks only placed jobs
        cause = reconcile.drained_cause(node)
        moved = await self.recorder.move_job(job, cause, still=lambda j: j.node == node)
        if not moved.applied or moved.job is None:
            return False
        self.logger.info(
            Event.JOB_REQUEUED,
            job_id=job.id,
            node=node,
            state=moved.from_state.value if moved.from_state else "",
            attempt=job.attempt,
            message=moved.job.message,
        )
        self.sent.discard(job.id)
        self._stop_and_hold(node, job.id, cause)
        return True

    def _stop_and_hold(self, node: str, job_id: str, cause: str) -> None:
        """Tell the node a job was lost with (or moved off) to stop it, and hold
        the job from dispatch until it answered or cannot (no responders, a
        timeout). A move's node is alive and answers once its trainer stopped. A node
        judged lost may still run it: an agent whose beats the bucket did not
        store while its server answered (an election, a member catching up)
        keeps its trainer, and a loss judged wrongly reaches a live agent. Sent
        elsewhere at once, the job ran in two places (nemesis, issue 33). An
        agent that cannot be reached has fenced itself by the time its node is
        lost (agent/DESIGN.md, "Fencing"). Cost: a job lost with a cut-off
        node waits up to the cancel's timeout before it runs again."""
        why = f"{cause}: it runs elsewhere"
        self.held[job_id] = self._spawn(self._cancel_on_node(node, job_id, why))

    def _holding(self) -> set[str]:
        """The jobs held now (a job failed with its node is held no longer than
        its request: the map keeps nothing that ended)."""
        self.held = {j: t for j, t in self.held.items() if not t.done()}
        return set(self.held)

    async def _dispatch_queued(
        self, queued: list[JobRecord], on_node: list[JobRecord], now: float
    ) -> None:
        busy = placement.busy_nodes(on_node, self.table.nodes, self.first_seen)
        plan = placement.plan_dispatch(queued, self.table.nodes, busy, now)
        by_id = {j.id: j for j in queued}
        for job_id, message in plan.waiting.items():
            await self.waiting.say(by_id[job_id], message)
        if plan.send:
            models = await self._models({j.model for j, _ in plan.send})
            for job, target in plan.send:
                await self._dispatch(job, target, models)

    async def _models(self, wanted: set[str]) -> dict[str, ModelRecord]:
        """The catalog, asked again only when a job names a model not seen yet
        (catalog entries are added, not changed)."""
        if not wanted <= self._model_cache.keys():
            self._model_cache = {m.name: m for m in await self.recorder.models()}
        return self._model_cache

    async def _dispatch(self, job: JobRecord, node: str, models: dict[str, ModelRecord]) -> None:
        model = models.get(job.model)
        if model is None:
            # The catalog entry went away after submit: nothing can train this.
            reply = await self.recorder.transition(
                TransitionRequest(
                    id=job.id,
                    from_state=JobState.QUEUED,
                    to_state=JobState.FAILED,
                    message=f"model {job.model} is no longer in the catalog; add it and submit "
                    "the job again",
                )
            )
            if reply.applied:
                self.logger.warning(Event.JOB_LOST, job_id=job.id, message=reply.job.message)
            return
        reply = await self.recorder.transition(
            TransitionRequest(
                id=job.id,
                from_state=JobState.QUEUED,
                to_state=JobState.STARTING,
                node=node,
                message=f"sent to {node}" + _attempt_of(job),
            )
        )
        if not reply.applied:
            self.logger.info(
                Event.TRANSITION_REFUSED,
                job_id=job.id,
                node=node,
                state=reply.job.state.value,
                message="the job moved on before dispatch (cancelled, or another scheduler)",
            )
            return
        self.first_seen[job.id] = self.clock()
        self.sent.add(job.id)
        resume = await self._resume_ref(reply.job)
        if isinstance(resume, str):
            await self.fail_on_node(reply.job, resume)
            return
        self._spawn(self._send_start(reply.job, node, start_request(reply.job, model, resume)))

    async def _resume_ref(self, job: JobRecord) -> CheckpointRef | str | None:
        """What `job` starts from (see the module doc); a str: why it cannot start."""
        if job.checkpoint is not None or job.resume_from is None:
            return job.checkpoint
        other = await self.recorder.get_job(job.resume_from)
        ref = reconcile.resume_ref(job, other)
        if ref is None:
            return (
                f"job {job.resume_from} (resume_from) has no checkpoint or adapter stored "
                "any more; submit the job again without resume_from, or from another job"
            )
        return ref

    async def _resend(self, job: JobRecord, node: str) -> None:
        """Send a `starting` job's start again: the leader that moved it may
        have died before it sent it."""
        model = (await self._models({job.model})).get(job.model)
        resume = await self._resume_ref(job)
        if model is None or isinstance(resume, str):
            # Nothing can train it, as a first dispatch would have found.
            gone = f"model {job.model} is no longer in the catalog; add it and submit the job again"
            await self.fail_on_node(job, gone if model is None else str(resume))
            return
        self.sent.add(job.id)
        self.first_seen[job.id] = self.clock()
        self.logger.info(
            Event.JOB_RESENT,
            job_id=job.id,
            node=node,
            attempt=job.attempt,
            message="the start may never have reached the node; sent again, same attempt",
        )
        start = start_request(job, model, resume)
        self._spawn(self._send_start(job, node, start, resent=True))

    async def _send_start(
        self, job: JobRecord, node: str, start: StartRequest, resent: bool = False
    ) -> None:
        reply = await ask_start(self.agents, node, start, self.logger, job.id)
        if reply is None:
            return
        if isinstance(reply, UnavailableError):  # presumed lost itself (agent/DESIGN.md): a loss
            said = f"the agent on {node} did not take the job: {reply}"
            await self.lose_on_node(job, f"the agent on {node} is presumed lost", said)
            return
        if reply.accepted:
            if reply.accepted_at is not None or reply.accepted_beat is not None:
                self.taken[job.id] = reconcile.Taken.of(reply)
            metrics.job_started(job.created_at)
            self.logger.info(
                Event.JOB_DISPATCHED, job_id=job.id, node=node, message=f"attempt {job.attempt}"
            )
            return
        self.logger.warning(Event.NODE_BUSY, job_id=job.id, node=node, message=reply.reason)
        said = f"the agent on {node} did not accept the job: {reply.reason or 'no reason given'}"
        if resent:
            # It had this attempt already (and ended it), or cannot take it now:
            # a loss, not the job's fault.
            await self.lose_on_node(job, f"the agent on {node} refused the start sent again", said)
            return
        await self.fail_on_node(job, said)

    async def _reconcile(self, on_node: list[JobRecord], now: float) -> None:
        ids = {j.id for j in on_node}
        for seen in (self.first_seen, self.taken, self.delivered_at):
            for job_id in seen.keys() - ids:
                del seen[job_id]
        self.sent &= ids
        for job in on_node:
            self.first_seen.setdefault(job.id, now)
        stale = reconcile.deliveries_never_stored(
            on_node, self.table.nodes, self.first_seen, self.delivered_at, now, self.store_wait_s
        )
        result = reconcile.reconcile(
            on_node,
            self.table.nodes,
            now,
            self.first_seen,
            view_since=self.table.touched_at,
            sent_here=self.sent,
            taken=self.taken,
        )
        for action in [*stale, *result.fail]:
            await self.lose_on_node(action.job, action.cause, action.message)
        for resend in result.resend:
            await self._resend(resend.job, resend.node)
        for check in result.check:
            found = await self.recorder.get_job(check.job_id)
            if reconcile.should_cancel_on_node(found, check.node):
                why = (
                    "unknown to the recorder"
                    if found is None
                    else f"the job is {found.state.value}"
                    + (f" on {found.node}" if found.node and found.node != check.node else "")
                )
                self._spawn(self._cancel_on_node(check.node, check.job_id, why))

    async def _cancel_on_node(self, node: str, job_id: str, reason: str) -> None:
        try:
            reply = await self.agents.cancel(node, NodeCancelRequest(job_id=job_id, reason=reason))
        except Exception as e:
            self.logger.warning(
                Event.REQUEST_FAILED, job_id=job_id, node=node, message="node cancel", error=repr(e)
            )
            return
        self.logger.info(
            Event.JOB_CANCELLED,
            job_id=job_id,
            node=node,
            message=f"told the node to stop: {reason} (stopped={reply.stopped})",
        )

    # --- cancel (any replica) -------------------------------------------

    async def cancel(self, req: JobCancelRequest) -> JobRecord:
        """Cancel a job: a queued one is never sent; an active one is stopped
        on its node once the recorder has committed. A final job is returned
        as it is."""
        message = f"cancelled: {req.reason}" if req.reason else "cancelled on request"
        job = await self.recorder.get_job(req.id)
        if job is None:
            raise NotFoundError(f"no job has id {req.id!r}", field="$.id")
        ended = await self.recorder.end_job(job, JobState.CANCELLED, message)
        if ended.applied and ended.job is not None and ended.from_state is not None:
            done = ended.job
            self.logger.info(
                Event.JOB_CANCELLED, job_id=done.id, node=done.node, state=ended.from_state.value
            )
            if ended.from_state in ON_NODE and done.node is not None:
                self._spawn(self._cancel_on_node(done.node, done.id, message))
            return done
        if ended.job is not None and ended.job.state in FINAL:
            return ended.job
        raise ConflictError(f"job {req.id} kept changing state; send the cancel again")


def _attempt_of(job: JobRecord) -> str:
    """ ", attempt 2 of 3" for the history of a job that may be sent more than once."""
    if job.max_attempts <= 1 and job.attempt == 0:
        return ""
    return f", attempt {job.attempt + 1} of {max(job.max_attempts, job.attempt + 1)}"


async def ask_start(
    agents: AgentRequests, node: str, start: StartRequest, logger: Any, job_id: str
) -> StartReply | UnavailableError | None:
    """The agent's answer to `start`: its reply (an error reply as a refusal),
    None when it did not answer (it may have the job: reconcile decides, see
    the module doc), or its UnavailableError: presumed lost itself, it did
    not take the job."""
    try:
        return await agents.start(node, start)
    except (TimeoutError, nats.errors.TimeoutError, nats.errors.NoRespondersError) as e:
        message = "the agent did not answer the start request; reconcile will decide"
        logger.warning(Event.REQUEST_FAILED, job_id=job_id, node=node, message=message,
                       error=repr(e))  # fmt: skip
    except UnavailableError as e:
        return e
    except ApiError as e:
        return StartReply(accepted=False, reason=str(e))
    except Exception as e:
        logger.warning(Event.REQUEST_FAILED, job_id=job_id, node=node, error=repr(e))
    return None


def start_request(
    job: JobRecord, model: ModelRecord, resume: CheckpointRef | None = None
) -> StartRequest:
    """What an agent is sent to start `job` (as the recorder holds it after
    the move to `starting`), from `resume` (`reconcile.resume_ref`) if any."""
    return StartRequest(
        resume=resume,
        job_id=job.id,
        attempt=job.attempt,
        model=model,
        gpu_memory_mib=job.gpu_memory_mib,
        dataset=job.dataset,
        dataset_sha256=job.dataset_sha256,
        eval_dataset=job.eval_dataset,
        eval_dataset_sha256=job.eval_dataset_sha256,
        params=job.params,
        artifacts=list(job.artifacts_expected),
        # With a serving policy the control plane places every replica, the
        # trainer's node's too (replica_rounds.py): no auto-serve beside it.
        serve=False if policy_of(job, model) is not None else job.serve,
    )
