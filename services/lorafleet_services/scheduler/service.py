"""The scheduler service: one replica, wired from its pieces.

It holds nothing durable: at start it rebuilds its node table from KV
`<prefix>_nodes` and asks the recorder everything else, so a restarted
scheduler (or the other replica) picks up where it stopped, and
compare-and-set in the recorder keeps a job from being sent twice. Its
tasks: the node watcher (nodes.py on a kv_watch.KeyWatch), the job-event
trigger (here), leadership (leadership.py: only the leader runs rounds; any
replica answers `nodes.list`, `jobs.cancel`, `adapters.serve`/`unserve`),
and the rounds (here, applied by dispatch.py): sweep, fail lost nodes'
jobs, dispatch, reconcile, woken by the triggers or every `SWEEP_S`.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import socket
import time
from collections.abc import Callable, Iterator
from typing import Any

import msgspec
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js import JetStreamContext

import lorafleet
from lorafleet import _runtime as runtime
from lorafleet import log, metrics
from lorafleet._recorder_client import RecorderClient
from lorafleet._tasks import stop_tasks
from lorafleet.log import Event
from lorafleet.nats._kv_watch import KeyWatch
from lorafleet.nats._micro import Route, start_service
from lorafleet.settings import Settings
from lorafleet.states import FINAL
from lorafleet_schemas.messages import (
    AdapterServeRequest,
    AdapterUnserveRequest,
    JobCancelRequest,
    JobEvent,
    JobRecord,
    JobState,
    NodeList,
    NodeListRequest,
    NodeScheduleRequest,
)
from lorafleet_services.scheduler.dispatch import AgentRequests, Dispatcher
from lorafleet_services.scheduler.leadership import Leadership
from lorafleet_services.scheduler.metric_views import node_samples
from lorafleet_services.scheduler.node_marks import NodeMarks
from lorafleet_services.scheduler.nodes import NodeWatcher
from lorafleet_services.scheduler.replica_rounds import ReplicaRounds
from lorafleet_services.scheduler.serving import ServeHandlers

#: Seconds between dispatch rounds when nothing wakes them (the safety net
#: behind the event triggers); default 1.
SWEEP_S = 1.0
#: Seconds without a round, as a share of the node timeout, beyond which
#: the scheduler was not looking (its process paused or starved): the nodes'
#: silence since is its own and is forgiven, as after a reconnect, before
#: the sweep, which would otherwise run before the watch hands over the beats
#: that came meanwhile (tests/nemesis/test_found.py). Half the timeout: a
#: shorter stall cannot age a beat past it (beats come every third of it).
STALL_SHARE = 0.5
#: Seconds between probes of the node watch (is it alive, can it see?):
#: blindness is noticed within about this plus the probe's 0.5 s timeout,
#: well before a 3 s node timeout could lose anybody.
WATCH_PROBE_S = 0.5


def instance_id() -> str:
    return f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(3)}"


class Scheduler:
    """One scheduler replica on an open connection.

    clock: monotonic seconds (injected for tests); default time.monotonic.
    instance: this replica's id in the leader key; default host-pid-random.
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
        self.logger = log.get(instance=self.instance)
        self._wake = asyncio.Event()
        #: When the rounds last ran (STALL_SHARE).
        self._last_round = clock()
        self.nodes = NodeWatcher(
            settings.node_timeout_s, clock, self.logger, self._wake.set, holds_lease=self.is_leader
        )
        self.leadership = Leadership(
            self.js, self.names, self.instance, self.logger, clock, on_acquired=self._acquired
        )
        self.dispatcher = Dispatcher(
            RecorderClient(
                nc,
                self.names,
                settings.request_timeout_s,
                no_responders_retry_s=settings.no_responders_retry_s,
            ),
            AgentRequests(nc, self.names, settings.request_timeout_s),
            self.nodes.table,
            clock,
            self.logger,
            store_wait_s=settings.delivery_store_wait_s,
        )
        self.serving = ServeHandlers(
            self.dispatcher.recorder, self.dispatcher.agents, self.nodes.table, self.logger
        )
        self.replicas = ReplicaRounds(
            self.dispatcher.recorder, self.dispatcher.agents, self.nodes.table, clock, self.logger
        )
        self.marks = NodeMarks(
            self.js, self.names, self.nodes.table, self.dispatcher.recorder, self.logger
        )
        self._node_watch = KeyWatch(
            self.js,
            self.names.nodes_bucket,
            ">",
            self.nodes.on_entry,
            self.logger,
            probe_s=WATCH_PROBE_S,
            on_view=self.nodes.view_changed,
            clock=clock,
        )
        self._rounds: asyncio.Task[None] | None = None
        self._stopping = False
        self._service: Any = None
        self._unregister: Callable[[], None] | None = None

    # --- lifecycle ------------------------------------------------------

    async def start(self) -> None:
        self._unregister = metrics.LIVE.add(self.metric_samples)
        self._node_watch.start()
        self.marks.watch.start()
        self.leadership.start()
        self._rounds = asyncio.create_task(self._run_rounds())
        await self.nc.subscribe(self.names.all_job_events, cb=self._on_job_event)
        self._service = await start_service(
            self.nc,
            self.names.scheduler_service,
            lorafleet.__version__,
            "lorafleet scheduler: nodes, dispatch, cancel, serve",
            self.routes(),
            self.names.queue_group,
        )

    def routes(self) -> list[Route]:
        """What every replica answers (the leader or not)."""
        return [
            Route(self.names.nodes_list, NodeListRequest, self.nodes_list),
            Route(self.names.nodes_schedule, NodeScheduleRequest, self.marks.schedule),
            Route(self.names.jobs_cancel, JobCancelRequest, self.cancel),
            Route(self.names.adapters_serve, AdapterServeRequest, self.serving.serve),
            Route(self.names.adapters_unserve, AdapterUnserveRequest, self.serving.unserve),
        ]

    async def stop(self) -> None:
        self._stopping = True
        self._wake.set()
        await stop_tasks(self._rounds)
        await self._node_watch.stop()
        await self.marks.watch.stop()
        await self.dispatcher.stop()
        await self.replicas.stop()
        if self._service is not None:
            with contextlib.suppress(Exception):
                await self._service.stop()
        # Last, so that the other replica takes over only once this one is idle.
        await self.leadership.stop()
        if self._unregister is not None:
            self._unregister()

    def metric_samples(self) -> Iterator[metrics.Sample]:
        """The node table and leadership, for the metrics endpoint."""
        now = self.clock()
        yield from node_samples(
            (n.heartbeat, n.alive, now - n.last_seen) for n in self.nodes.table.nodes.values()
        )
        yield metrics.LEADER, (), float(self.is_leader())

    def reconnected(self) -> None:
        """Called after the connection came back: re-watch (every key's last
        value again), and forgive the silence (it was ours, not the nodes')."""
        self.nodes.reconnected()
        self._node_watch.restart()
        self.marks.watch.restart()
        self.leadership.restart_watch()
        self._wake.set()

    def _acquired(self) -> None:
        self.nodes.leading()
        self._wake.set()

    def is_leader(self) -> bool:
        return self.leadership.is_leader()

    # --- triggers and rounds --------------------------------------------

    async def _on_job_event(self, msg: Msg) -> None:
        # Cheap filter first: progress events are most of the traffic.
        if b'"kind":"state"' not in msg.data:
            return
        try:
            event = msgspec.json.decode(msg.data, type=JobEvent)
        except msgspec.DecodeError:
            return
        if event.job.state is JobState.DONE:
            self.replicas.nudge()
        if event.job.state is JobState.QUEUED or event.job.state in FINAL:
            self._wake.set()

    async def _run_rounds(self) -> None:
        while not self._stopping:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), SWEEP_S)
            self._wake.clear()
            if self._stopping:
                return
            if not self.nc.is_connected:
                continue
            now = self.clock()
            if now - self._last_round > STALL_SHARE * self.settings.node_timeout_s:
                self.nodes.reconnected()
            self._last_round = now
            self.nodes.sweep(now, majority_at=self.leadership.majority_at)
            if not self.is_leader():
                # The leader fails lost nodes' jobs; reconcile catches any it missed.
                self.nodes.take_lost()
                continue
            try:
                with metrics.DISPATCH_ROUND.time():
                    await self.round(now)
            except Exception as e:
                self.logger.warning(Event.REQUEST_FAILED, message="dispatch round", error=repr(e))

    async def round(self, now: float) -> None:
        """One pass: fail lost nodes' jobs, dispatch queued jobs, reconcile,
        keep the placed replicas placed."""
        if not self.nodes.synced:
            return  # the node table is not complete yet: every node would look unknown
        await self.dispatcher.round(now, self.nodes.take_lost())
        await self.replicas.round(now)

    # --- API handlers ---------------------------------------------------

    async def nodes_list(self, req: NodeListRequest) -> NodeList:
        del req
        return NodeList(nodes=self.nodes.table.infos())

    async def cancel(self, req: JobCancelRequest) -> JobRecord:
        return await self.dispatcher.cancel(req)


async def make(nc: Client, settings: Settings) -> Scheduler:
    return Scheduler(nc, settings)


#: How `runtime.serve` runs the scheduler (its NATS client is "lorafleet-scheduler";
#: after a reconnect serve calls `Scheduler.reconnected`).
PROGRAM = runtime.Program("scheduler", make)
