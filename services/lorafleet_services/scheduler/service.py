"""The scheduler service: the NATS glue around logic.py.

It holds nothing durable. At start it rebuilds its node table from KV
`<prefix>_nodes` (a watcher delivers every key's last value, then every
beat and every expiry marker), and everything else it asks the recorder.
Kill it at any moment: a restarted scheduler (or the other replica) picks
up where it stopped, and compare-and-set in the recorder keeps a job from
being sent twice.

What runs (asyncio tasks):

- the node watcher: heartbeats into the node table; an expiry marker (or
  the 1 s sweep) marks a node lost and queues its jobs for failing;
- the job-event watcher: wakes the dispatcher when a job is queued or ends;
- leadership: one scheduler leads through key `scheduler` of KV
  `<prefix>_leader`, created with a TTL of `bus.LEADER_TTL_S` and renewed
  every `LEADER_RENEW_S` with compare-and-set on its revision; the others
  watch the key and take it the moment it expires. Only the leader
  dispatches, fails the jobs of lost nodes and reconciles; any replica
  answers `nodes.list` and `jobs.cancel` (cancel is compare-and-set too);
- the dispatcher: one round at a time, woken by the triggers above or
  every `SWEEP_S`: sweep, fail lost nodes' jobs, dispatch, reconcile.

Dispatch, and why a refused start fails the job: the job moves queued ->
starting by compare-and-set *before* the start request goes out (so two
schedulers cannot both send it). The state machine never lets a job back
to `queued`, so a start the agent explicitly refuses fails the job with the
agent's reason. A start request that gets no answer leaves the job
`starting`: the agent may have taken it, and reconcile decides within its
grace (the heartbeat names the job, or the job fails as lost).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import socket
import time
from collections.abc import Callable, Coroutine
from typing import Any

import msgspec
import nats.errors
import nats.js.errors
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.api import Header
from nats.js.kv import KV_DEL, KV_PURGE, KeyValue

from lorafleet import bus, log
from lorafleet.bus import LEADER_TTL_S
from lorafleet.errors import ApiError, BadRequestError, ConflictError, NotFoundError
from lorafleet.log import Event
from lorafleet.recorder_client import RecorderClient
from lorafleet.service import Route, start_service
from lorafleet.settings import Settings
from lorafleet.states import FINAL, ON_NODE
from lorafleet_schemas.messages import (
    Heartbeat,
    JobCancelRequest,
    JobEvent,
    JobListRequest,
    JobRecord,
    JobState,
    ModelRecord,
    NodeCancelReply,
    NodeCancelRequest,
    NodeList,
    NodeListRequest,
    StartReply,
    StartRequest,
    TransitionRequest,
)
from lorafleet_services.scheduler import logic
from lorafleet_services.scheduler.logic import BeatChange, Node, NodeTable

VERSION = "0.1.0"
#: Seconds between dispatch rounds when nothing wakes the dispatcher (the
#: safety net behind the event triggers); default 1.
SWEEP_S = 1.0
#: Seconds between reconcile passes (each asks the recorder about jobs nodes
#: run that it does not hold active); default 1.
RECONCILE_EVERY_S = 1.0
#: Seconds between renewals of the leader key (its TTL is bus.LEADER_TTL_S).
LEADER_RENEW_S = 1.0
#: The leader stops acting this many seconds before its key could have
#: expired without a renewal, so two leaders never act at once.
LEADER_SAFETY_S = 0.5
#: The key in the leader bucket.
LEADER_KEY = "scheduler"
#: Most jobs one list request returns (the recorder's cap).
LIST_LIMIT = 1000
#: JetStream's error code for a wrong expected last subject sequence.
_WRONG_LAST_SEQUENCE = (10071, 10164)


def instance_id() -> str:
    return f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(3)}"


class Scheduler:
    """One scheduler replica on an open connection.

    clock: monotonic seconds (injected for tests); default time.monotonic.
    """

    def __init__(
        self,
        nc: Client,
        settings: Settings,
        clock: Callable[[], float] = time.monotonic,
        instance: str | None = None,
    ) -> None:
        self.nc = nc
        self.js: JetStreamContext = nc.jetstream()
        self.settings = settings
        self.names = settings.names
        self.clock = clock
        self.instance = instance or instance_id()
        self.table = NodeTable()
        self.recorder = RecorderClient(nc, self.names, settings.request_timeout_s)
        self.log = log.get(instance=self.instance)
        #: True once the node watcher has delivered the bucket's current content.
        self.synced = False
        self._wake = asyncio.Event()
        self._stopping = asyncio.Event()
        self._leader_changed = asyncio.Event()
        self._leader_rev = 0
        self._lease_until = 0.0
        self._reconnected_at: float | None = None
        self._lost_pending: list[Node] = []
        self._first_seen: dict[str, float] = {}
        self._last_reconcile = 0.0
        self._waiting_said: dict[str, str] = {}
        self._model_cache: dict[str, ModelRecord] = {}
        self._message_updates = True
        self._tasks: list[asyncio.Task[None]] = []
        self._background: set[asyncio.Task[Any]] = set()
        self._watchers: list[KeyValue.KeyWatcher] = []
        self._service: Any = None

    # --- lifecycle ------------------------------------------------------

    async def start(self) -> None:
        self._tasks = [
            asyncio.create_task(self._watch(self.names.nodes_bucket, ">", self._on_node_entry)),
            asyncio.create_task(
                self._watch(self.names.leader_bucket, LEADER_KEY, self._on_leader_entry)
            ),
            asyncio.create_task(self._leadership()),
            asyncio.create_task(self._dispatcher()),
        ]
        await self.nc.subscribe(self.names.all_job_events, cb=self._on_job_event)
        self._service = await start_service(
            self.nc,
            self.names.scheduler_service,
            VERSION,
            "lorafleet scheduler: nodes, dispatch, cancel",
            [
                Route(self.names.nodes_list, NodeListRequest, self.nodes_list),
                Route(self.names.jobs_cancel, JobCancelRequest, self.cancel),
            ],
            self.names.queue_group,
        )

    async def stop(self) -> None:
        self._stopping.set()
        self._wake.set()
        for w in self._watchers:
            with contextlib.suppress(Exception):
                await w.stop()  # type: ignore[no-untyped-call]
        # Pending start and node-cancel requests too: what they would have
        # done, reconcile does for the next leader.
        for t in [*self._tasks, *self._background]:
            t.cancel()
        for t in [*self._tasks, *self._background]:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        if self._service is not None:
            with contextlib.suppress(Exception):
                await self._service.stop()
        if self.is_leader():
            # Hand over at once rather than after the TTL.
            with contextlib.suppress(Exception):
                kv = await self.js.key_value(self.names.leader_bucket)
                await kv.delete(LEADER_KEY, last=self._leader_rev)
        self._lease_until = 0.0

    def reconnected(self) -> None:
        """Called after the connection came back: re-watch, and forgive the
        silence (it was ours, not the nodes')."""
        self._reconnected_at = self.clock()
        self.table.touch_all(self._reconnected_at)
        for w in list(self._watchers):
            self._spawn(w.stop())  # type: ignore[no-untyped-call]
        self._wake.set()

    def _spawn(self, coro: Coroutine[Any, Any, Any]) -> None:
        task = asyncio.create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    # --- requests to the recorder and agents ----------------------------

    async def _request(self, subject: str, msg: Any, reply: type[Any]) -> Any:
        return await bus.request(
            self.nc, subject, msg, reply, timeout_s=self.settings.request_timeout_s
        )

    async def _fail(self, job: JobRecord, message: str, event: str = Event.JOB_LOST) -> bool:
        """Fail `job` from whatever active state it is in, while it is still on its node."""
        ended = await self.recorder.fail_job(job, message, still=lambda j: j.node == job.node)
        if ended.applied:
            self.log.warning(
                event,
                job_id=job.id,
                node=job.node,
                state=ended.from_state.value if ended.from_state else "",
                message=message,
            )
        return ended.applied

    # --- KV watchers ----------------------------------------------------

    async def _watch(
        self, bucket: str, keys: str, on_entry: Callable[[KeyValue.Entry | None], None]
    ) -> None:
        """Watch `keys` of `bucket` until stopped; a stopped watcher (after a
        reconnect) or a failure starts a fresh one, which redelivers every
        key's last value."""
        while not self._stopping.is_set():
            watcher: KeyValue.KeyWatcher | None = None
            try:
                kv = await self.js.key_value(bucket)
                watcher = await kv.watch(keys)
                self._watchers.append(watcher)
                async for entry in watcher:
                    on_entry(entry)
            except asyncio.CancelledError:
                raise
            except Exception as e:
                self.log.warning(Event.NATS_ERROR, message=f"watching {bucket}", error=repr(e))
                await asyncio.sleep(0.5)
            finally:
                if watcher is not None and watcher in self._watchers:
                    self._watchers.remove(watcher)

    def _on_node_entry(self, entry: KeyValue.Entry | None) -> None:
        if entry is None:
            # The bucket's current content is in: a node missing now is gone.
            if not self.synced:
                self.synced = True
                self._wake.set()
            return
        if entry.operation in (KV_PURGE, KV_DEL):
            if self._in_reconnect_grace():
                # The server may have expired beats that could not reach it
                # while it was down; the sweep judges these nodes from now on.
                self.log.info(Event.NODE_LOST, node=entry.key, message="expiry marker right "
                              "after a reconnect: left to the sweep")  # fmt: skip
                return
            node = self.table.expire(entry.key)
            if node is not None:
                self._node_lost(node, "expired")
            return
        try:
            hb = msgspec.json.decode(entry.value or b"", type=Heartbeat)
        except msgspec.DecodeError as e:
            self.log.warning(Event.NATS_ERROR, node=entry.key, error=f"bad heartbeat: {e}")
            return
        change = self.table.beat(hb, self.clock())
        if change is BeatChange.UP:
            self.log.info(
                Event.NODE_UP, node=hb.node, message=f"{len(hb.cards)} cards", job_id=hb.job
            )
            self._wake.set()
        elif change is BeatChange.IDLE:
            self._wake.set()

    def _in_reconnect_grace(self) -> bool:
        since = self._reconnected_at
        return since is not None and self.clock() - since < self.settings.node_timeout_s

    def _node_lost(self, node: Node, how: str) -> None:
        self.log.warning(
            Event.NODE_LOST,
            node=node.name,
            job_id=node.running,
            message=f"{how}; last beat {logic.utc_hms(node.heartbeat.time)}",
        )
        self._lost_pending.append(node)
        self._wake.set()

    async def _on_job_event(self, msg: Msg) -> None:
        # Cheap filter first: progress events are most of the traffic.
        if b'"kind":"state"' not in msg.data:
            return
        try:
            event = msgspec.json.decode(msg.data, type=JobEvent)
        except msgspec.DecodeError:
            return
        if event.job.state is JobState.QUEUED or event.job.state in FINAL:
            self._wake.set()

    # --- leadership -----------------------------------------------------

    def is_leader(self) -> bool:
        return self.clock() < self._lease_until

    def _on_leader_entry(self, entry: KeyValue.Entry | None) -> None:
        if entry is not None and entry.operation in (KV_PURGE, KV_DEL):
            self._leader_changed.set()

    async def _leadership(self) -> None:
        kv_subject = self.names.kv_subject(self.names.leader_bucket, LEADER_KEY)
        while not self._stopping.is_set():
            was = self.is_leader()
            try:
                if self._lease_until > 0:
                    await self._renew(kv_subject)
                else:
                    await self._acquire(kv_subject)
            except asyncio.CancelledError:
                raise
            except Exception as e:
                if self._lease_until > 0:
                    self._lease_until = 0.0
                    self.log.warning(Event.LEADER_LOST, error=repr(e))
                else:
                    self.log.debug(Event.NATS_ERROR, message="leader election", error=repr(e))
            if self.is_leader() and not was:
                self._wake.set()
            self._leader_changed.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._leader_changed.wait(), LEADER_RENEW_S)

    async def _acquire(self, subject: str) -> None:
        stream = f"KV_{self.names.leader_bucket}"
        last = 0
        try:
            current = await self.js.get_msg(stream, subject=subject)
        except nats.js.errors.NotFoundError:
            pass
        else:
            headers = current.headers or {}
            deleted = "KV-Operation" in headers or "Nats-Marker-Reason" in headers
            if not deleted and current.data != self.instance.encode():
                return  # someone else leads
            last = current.seq or 0
        started = self.clock()
        try:
            ack = await self.js.publish(
                subject,
                self.instance.encode(),
                headers={Header.EXPECTED_LAST_SUBJECT_SEQUENCE: str(last)},
                msg_ttl=LEADER_TTL_S,
            )
        except nats.js.errors.APIError as e:
            if e.err_code in _WRONG_LAST_SEQUENCE:
                return  # lost the race to another replica
            raise
        self._leader_rev = ack.seq
        self._lease_until = started + LEADER_TTL_S - LEADER_SAFETY_S
        self.log.info(Event.LEADER_ACQUIRED, message=self.instance)

    async def _renew(self, subject: str) -> None:
        started = self.clock()
        try:
            ack = await self.js.publish(
                subject,
                self.instance.encode(),
                headers={Header.EXPECTED_LAST_SUBJECT_SEQUENCE: str(self._leader_rev)},
                msg_ttl=LEADER_TTL_S,
            )
        except nats.js.errors.APIError as e:
            if e.err_code in _WRONG_LAST_SEQUENCE:
                self._lease_until = 0.0
                self.log.warning(Event.LEADER_LOST, message="another scheduler holds the key")
                return
            raise
        self._leader_rev = ack.seq
        self._lease_until = started + LEADER_TTL_S - LEADER_SAFETY_S

    # --- the dispatcher -------------------------------------------------

    async def _dispatcher(self) -> None:
        while not self._stopping.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), SWEEP_S)
            self._wake.clear()
            if self._stopping.is_set():
                return
            if not self.nc.is_connected:
                continue
            now = self.clock()
            for node in self.table.sweep(now, self.settings.node_timeout_s):
                self._node_lost(node, "no heartbeat")
            if not self.is_leader():
                # The leader fails lost nodes' jobs; reconcile catches any it missed.
                self._lost_pending.clear()
                continue
            try:
                await self.round(now)
            except asyncio.CancelledError:
                raise
            except Exception as e:
                self.log.warning(Event.REQUEST_FAILED, message="dispatch round", error=repr(e))

    async def round(self, now: float) -> None:
        """One pass: fail lost nodes' jobs, dispatch queued jobs, reconcile."""
        if not self.synced:
            return  # the node table is not complete yet: every node would look unknown
        # Both lists at once: the round's latency is mostly these round trips.
        on_node, queued = await asyncio.gather(
            self.recorder.list_jobs(JobListRequest(states=sorted(ON_NODE), limit=LIST_LIMIT)),
            self.recorder.list_jobs(
                JobListRequest(state=JobState.QUEUED, oldest_first=True, limit=LIST_LIMIT)
            ),
        )
        failed: set[str] = set()
        lost, self._lost_pending = self._lost_pending, []
        for node in lost:
            for job in logic.jobs_lost_with(node, on_node, self._first_seen):
                if await self._fail(job, logic.node_lost_message(node)):
                    failed.add(job.id)
        if queued:
            busy = logic.busy_nodes(on_node, self.table.nodes, self._first_seen)
            plan = logic.plan_dispatch(queued, self.table.nodes, busy, now)
            by_id = {j.id: j for j in queued}
            for job_id, message in plan.waiting.items():
                await self._say_waiting(by_id[job_id], message)
            if plan.send:
                models = await self._models({j.model for j, _ in plan.send})
                for job, target in plan.send:
                    await self._dispatch(job, target, models)
        if self.synced and now - self._last_reconcile >= RECONCILE_EVERY_S:
            self._last_reconcile = now
            await self._reconcile([j for j in on_node if j.id not in failed], now)

    async def _models(self, wanted: set[str]) -> dict[str, ModelRecord]:
        """The catalog, asked again only when a job names a model not seen yet
        (catalog entries are added, not changed)."""
        if not wanted <= self._model_cache.keys():
            self._model_cache = {m.name: m for m in await self.recorder.models()}
        return self._model_cache

    async def _say_waiting(self, job: JobRecord, message: str) -> None:
        if self._waiting_said.get(job.id) == message:
            return
        self._waiting_said[job.id] = message
        if len(self._waiting_said) > 10 * LIST_LIMIT:
            self._waiting_said.clear()
        self.log.info(Event.JOB_WAITING, job_id=job.id, node=job.node, message=message)
        if job.message == message or not self._message_updates:
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
            self._message_updates = False
            self.log.warning(
                Event.TRANSITION_REFUSED,
                job_id=job.id,
                message="the recorder cannot set a queued job's message; "
                "waiting reasons are only logged",
                error=str(e),
            )

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
                self.log.warning(Event.JOB_LOST, job_id=job.id, message=reply.job.message)
            return
        reply = await self.recorder.transition(
            TransitionRequest(
                id=job.id,
                from_state=JobState.QUEUED,
                to_state=JobState.STARTING,
                node=node,
                message=f"sent to {node}",
            )
        )
        if not reply.applied:
            self.log.info(
                Event.TRANSITION_REFUSED,
                job_id=job.id,
                node=node,
                state=reply.job.state.value,
                message="the job moved on before dispatch (cancelled, or another scheduler)",
            )
            return
        self._first_seen[job.id] = self.clock()
        sent = reply.job
        start = StartRequest(
            job_id=sent.id,
            attempt=sent.attempt,
            model=model,
            gpu_memory_mib=sent.gpu_memory_mib,
            dataset=sent.dataset,
            dataset_sha256=sent.dataset_sha256,
            params=sent.params,
            artifacts=list(sent.artifacts_expected),
        )
        # The reply is awaited off the round: an agent that does not answer
        # must not hold up the other nodes' jobs.
        self._spawn(self._send_start(sent, node, start))

    async def _send_start(self, job: JobRecord, node: str, start: StartRequest) -> None:
        try:
            reply: StartReply = await self._request(self.names.node_start(node), start, StartReply)
        except (TimeoutError, nats.errors.TimeoutError, nats.errors.NoRespondersError) as e:
            # The agent may have the job: reconcile decides (see the module doc).
            self.log.warning(
                Event.REQUEST_FAILED,
                job_id=job.id,
                node=node,
                message="the agent did not answer the start request; reconcile will decide",
                error=repr(e),
            )
            return
        except ApiError as e:
            reply = StartReply(accepted=False, reason=str(e))
        except Exception as e:
            self.log.warning(Event.REQUEST_FAILED, job_id=job.id, node=node, error=repr(e))
            return
        if reply.accepted:
            self.log.info(
                Event.JOB_DISPATCHED, job_id=job.id, node=node, message=f"attempt {job.attempt}"
            )
            return
        self.log.warning(Event.NODE_BUSY, job_id=job.id, node=node, message=reply.reason)
        await self._fail(
            job,
            f"the agent on {node} did not accept the job: {reply.reason or 'no reason given'}",
            Event.JOB_LOST,
        )

    async def _reconcile(self, on_node: list[JobRecord], now: float) -> None:
        ids = {j.id for j in on_node}
        for job_id in list(self._first_seen):
            if job_id not in ids:
                del self._first_seen[job_id]
        for job in on_node:
            self._first_seen.setdefault(job.id, now)
        result = logic.reconcile(on_node, self.table.nodes, now, self._first_seen)
        for action in result.fail:
            await self._fail(action.job, action.message)
        for check in result.check:
            found = await self.recorder.get_job(check.job_id)
            if logic.should_cancel_on_node(found):
                why = (
                    "unknown to the recorder"
                    if found is None
                    else f"the job is {found.state.value}"
                )
                self._spawn(self._cancel_on_node(check.node, check.job_id, why))

    async def _cancel_on_node(self, node: str, job_id: str, reason: str) -> None:
        try:
            reply: NodeCancelReply = await bus.request(
                self.nc,
                self.names.node_cancel(node),
                NodeCancelRequest(job_id=job_id, reason=reason),
                NodeCancelReply,
                timeout_s=max(self.settings.request_timeout_s, 15.0),
            )
        except Exception as e:
            self.log.warning(
                Event.REQUEST_FAILED, job_id=job_id, node=node, message="node cancel", error=repr(e)
            )
            return
        self.log.info(
            Event.JOB_CANCELLED,
            job_id=job_id,
            node=node,
            message=f"told the node to stop: {reason} (stopped={reply.stopped})",
        )

    # --- API handlers ---------------------------------------------------

    async def nodes_list(self, req: NodeListRequest) -> NodeList:
        del req
        return NodeList(nodes=self.table.infos())

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
            self.log.info(
                Event.JOB_CANCELLED, job_id=done.id, node=done.node, state=ended.from_state.value
            )
            if ended.from_state in ON_NODE and done.node is not None:
                self._spawn(self._cancel_on_node(done.node, done.id, message))
            return done
        if ended.job is not None and ended.job.state in FINAL:
            return ended.job
        raise ConflictError(f"job {req.id} kept changing state; send the cancel again")


async def run(settings: Settings, stop: asyncio.Event) -> None:
    """The scheduler process: connect, ensure the layout, serve until `stop`."""
    logger = log.get()
    holder: list[Scheduler] = []

    async def reconnected_cb() -> None:
        logger.info(Event.NATS_RECONNECTED)
        if holder:
            holder[0].reconnected()

    nc = await bus.connect(settings, "lorafleet-scheduler", reconnected_cb=reconnected_cb)
    try:
        await bus.ensure_layout(nc.jetstream(), bus.layout_for(settings))
        scheduler = Scheduler(nc, settings)
        holder.append(scheduler)
        await scheduler.start()
        logger.info(Event.SERVICE_STARTED, service_name=settings.names.scheduler_service)
        await stop.wait()
        await scheduler.stop()
    finally:
        await bus.drain_quietly(nc)
        logger.info(Event.SERVICE_STOPPED)
