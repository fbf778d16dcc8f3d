"""The node agent process: heartbeat, start and cancel requests, fencing.

Subscribes to its own node's subjects only (`<prefix>.node.<node>.start`,
`.cancel`, `.checkpoint`, `.serve`, `.unserve`), so a node can run with credentials limited
to them. One job at a time (a retried start of the running job is accepted
again, one of a job that ended here refused, any other answered busy);
serving (serving/agent.py) runs beside it. Fenced (agent/DESIGN.md,
"Fencing"), it stops the job and later reports it failed. At start it kills
what an earlier agent left (node/leftovers.py); its trainer dies with it
(a parent-death signal); on SIGTERM the job is stopped and reported
`failed`, and the heartbeat key deleted so the scheduler knows at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
from collections.abc import Awaitable, Callable

from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.js import JetStreamContext
from nats.micro.request import Request

import lorafleet
from lorafleet import _runtime as runtime
from lorafleet import log, metrics
from lorafleet._tasks import stop_tasks
from lorafleet.errors import UnavailableError
from lorafleet.log import Event
from lorafleet.names import KV_DEL, Header, InvalidNameError, check_token, status_msg_id
from lorafleet.nats._bus import encode
from lorafleet.nats._micro import Route, endpoint
from lorafleet.settings import Settings
from lorafleet_schemas.messages import (
    JobState,
    NodeCancelReply,
    NodeCancelRequest,
    NodeCheckpointReply,
    NodeCheckpointRequest,
    NodeServeRequest,
    NodeUnserveRequest,
    StartReply,
    StartRequest,
    StatusReport,
)
from lorafleet_services.agent.config import AgentConfig
from lorafleet_services.agent.heartbeat import Heartbeater, fence_bound_s, fence_reason
from lorafleet_services.agent.metric_views import RUNNING_JOBS
from lorafleet_services.agent.node.engine_load import LoadTarget
from lorafleet_services.agent.node.leftovers import kill_leftover_trainers, remove_job_dirs
from lorafleet_services.agent.serving.agent import ServingAgent
from lorafleet_services.agent.training.job_run import JobRun, StopRequest
from lorafleet_services.agent.training.yielding import load_targets
from lorafleet_services.agent.transfer.checkpoints import CHECKPOINT_NOW_FILE, ask_checkpoint

#: Seconds the heartbeat's delete may take on a clean stop.
HEARTBEAT_DELETE_TIMEOUT_S = 2.0

#: Seconds between checks of the fencing condition.
FENCE_CHECK_S = 0.25
#: Seconds beyond the cancel grace a cancel request waits for the job to end.
CANCEL_SLACK_S = 5.0
#: Jobs whose end is remembered, so that a late retried start is not run twice.
ENDED_KEPT = 256
#: Seconds the fenced job's failure report is tried for once unfenced.
FENCED_REPORT_TIMEOUT_S = 10.0
#: Seconds the serving reports still queued may take to publish on a clean stop.
SERVING_STOP_TIMEOUT_S = 5.0


class Agent:
    """The node's agent on one NATS connection."""

    def __init__(self, nc: Client, js: JetStreamContext, settings: Settings, cfg: AgentConfig):
        self.nc = nc
        self.js = js
        self.settings = settings
        self.names = settings.names
        self.cfg = cfg
        self.node = cfg.node
        self.job: JobRun | None = None
        #: (job, attempt) -> how it ended, for the last ENDED_KEPT jobs.
        self.ended: dict[tuple[str, int], str] = {}
        self.fenced = False
        self._fence_task: asyncio.Task[None] | None = None
        #: The fenced job's failure, published once a beat is acknowledged again.
        self._fenced_report: StatusReport | None = None
        self._subs: list[Subscription] = []
        self._tasks: list[asyncio.Task[None]] = []
        self._stop = asyncio.Event()
        self._unregister_metrics: Callable[[], None] = lambda: None
        self.logger = log.get(node=cfg.node)
        self.serving = ServingAgent(js, self.names, cfg)
        self.heartbeat = Heartbeater(
            js, settings, cfg, version=lorafleet.__version__, current_job=self.current_job,
            serving=self.serving.watch.refs,
        )  # fmt: skip

    def current_job(self) -> str | None:
        return self.job.job_id if self.job is not None else None

    # --- lifecycle ------------------------------------------------------------

    def routes(self) -> list[Route]:
        return [
            Route(self.names.node_start(self.node), StartRequest, self.start_job),
            Route(self.names.node_cancel(self.node), NodeCancelRequest, self.cancel_job),
            Route(
                self.names.node_checkpoint(self.node), NodeCheckpointRequest, self.checkpoint_job
            ),
            Route(self.names.node_serve(self.node), NodeServeRequest, self.serving.serve_request),
            Route(self.names.node_unserve(self.node), NodeUnserveRequest, self.serving.unserve),
        ]

    async def start(self) -> None:
        """Answer this node's start and cancel requests; heartbeat; watch the fence."""
        # Separate subscriptions: a cancel that waits for a trainer to stop does
        # not hold up a start's busy reply, and neither waits on the other.
        for r in self.routes():
            self._subs.append(await self.nc.subscribe(r.subject, cb=answering(r)))
        await self.nc.flush()
        self._tasks = [
            asyncio.create_task(self.heartbeat.run(self._stop), name="heartbeat"),
            asyncio.create_task(self.watch_fence(self._stop), name="fence"),
            *self.serving.start(self._stop),
        ]
        RUNNING_JOBS.linger_s = self.settings.metrics_linger_s
        self._unregister_metrics = metrics.LIVE.add(RUNNING_JOBS.samples)

    async def stop(self) -> None:
        """Take no more requests, stop the running job (reported `failed`) and
        delete this node's heartbeat, so the scheduler knows at once."""
        for s in self._subs:
            with contextlib.suppress(Exception):
                await s.unsubscribe()
        self._stop.set()
        await stop_tasks(*self._tasks)
        await self.serving.stop(SERVING_STOP_TIMEOUT_S)
        await self.shutdown()
        self._unregister_metrics()

    # --- requests -------------------------------------------------------------

    async def start_job(self, req: StartRequest) -> StartReply:
        try:
            check_token(req.job_id, "job id")
        except InvalidNameError as e:
            self.logger.warning(Event.JOB_REFUSED, job_id=req.job_id, message=str(e))
            return StartReply(accepted=False, reason=str(e))
        presumed_lost = self._presumed_lost()
        if presumed_lost is not None:
            # Frozen (SIGSTOP, a stalled host) or cut off past the fence's
            # bound, it may be lost and the job sent elsewhere: a start read
            # from its socket on waking, before the fence check ran, made a
            # job run on two nodes (nemesis seed 16). Unavailable, not a
            # refusal: the scheduler requeues the job.
            self.logger.warning(Event.JOB_REFUSED, job_id=req.job_id, message=presumed_lost)
            raise UnavailableError(
                f"{self.node} is presumed lost ({presumed_lost}): it takes no job until a "
                "heartbeat of its is stored again"
            )
        ended = self.ended.get((req.job_id, req.attempt))
        if ended is not None:
            # A start retried after the job ran here already: running it again
            # would deliver twice. The scheduler sends a new attempt to rerun.
            reason = f"{self.node} already ran attempt {req.attempt} of job {req.job_id}"
            return StartReply(accepted=False, reason=f"{reason}; it ended {ended}")
        running = self.job
        if running is not None:
            if running.job_id == req.job_id and running.req.attempt == req.attempt:
                # a retried request: already running (taken no later than now)
                return self._taken()
            self.logger.info(Event.NODE_BUSY, job_id=req.job_id, running_job=running.job_id)
            return StartReply(
                accepted=False,
                reason=f"{self.node} is busy with job {running.job_id} "
                f"(attempt {running.req.attempt})",
                running_job=running.job_id,
            )
        run = JobRun(
            self.js, self.names, self.cfg, req,
            on_delivered=self.serving.job_delivered, engines=self._load_targets,
        )  # fmt: skip
        self.job = run
        run.start().add_done_callback(lambda _t: self._job_ended(run))
        self.logger.info(Event.JOB_ACCEPTED, job_id=req.job_id, attempt=req.attempt)
        self.heartbeat.poke()
        return self._taken()

    def _taken(self) -> StartReply:
        """Accepted, taken now: by the agent's clock and by its beat count
        (the beats numbered above it name the job while it runs)."""
        return StartReply(
            accepted=True, accepted_at=dt.datetime.now(dt.UTC),
            agent_started_at=self.heartbeat.started_at, accepted_beat=self.heartbeat.composed,
        )  # fmt: skip

    def _job_ended(self, run: JobRun) -> None:
        RUNNING_JOBS.ended(self.node, run.job_id)
        self.ended[(run.job_id, run.req.attempt)] = {
            None: "when the agent was fenced",
            JobState.UPLOADING: "with its artifacts delivered",
        }.get(run.final_state, str(run.final_state))
        while len(self.ended) > ENDED_KEPT:
            self.ended.pop(next(iter(self.ended)))
        if self.job is run:
            self.job = None
            self.logger.info(Event.JOB_FINISHED, job_id=run.job_id, state=run.final_state)
            self.heartbeat.poke()

    def _load_targets(self) -> list[LoadTarget]:
        """The engines a job yielding to serving reads: the vLLM servers of the
        last engine read, and the configured llama-servers."""
        vllm = [(v.server.url, v.server.api_key, v.server.pid)
                for v in self.serving.watch.views.values()]  # fmt: skip
        return load_targets(vllm, self.cfg.llamacpp_servers)

    async def cancel_job(self, req: NodeCancelRequest) -> NodeCancelReply:
        run = self.job
        if run is None or run.job_id != req.job_id:
            return NodeCancelReply(stopped=False)
        reason = req.reason or "cancelled"
        await run.stop(
            StopRequest.cancelled(f"cancelled on {self.node}: {reason}"),
            self.cfg.cancel_grace_s + CANCEL_SLACK_S,
        )
        return NodeCancelReply(stopped=run.task is not None and run.task.done())

    async def checkpoint_job(self, req: NodeCheckpointRequest) -> NodeCheckpointReply:
        run = self.job
        if run is None or (run.job_id, run.req.attempt) != (req.job_id, req.attempt):
            return NodeCheckpointReply(asked=False, reason=f"{self.node} does not run it")
        if run.trainer_pid is None:
            return NodeCheckpointReply(asked=False, reason="its trainer has not started")
        await asyncio.to_thread(ask_checkpoint, run.job_dir / CHECKPOINT_NOW_FILE)
        self.logger.info(Event.JOB_CHECKPOINT_ASKED, job_id=req.job_id, attempt=req.attempt)
        return NodeCheckpointReply(asked=True)

    # --- fencing --------------------------------------------------------------

    def _presumed_lost(self) -> str | None:
        """Why the scheduler may hold this node lost now (the fence's reason,
        also before the fence's own check has run), or None."""
        now = asyncio.get_running_loop().time()
        timeout_s = self.settings.node_timeout_s
        silent_s = now - self.heartbeat.last_ack
        reason = fence_reason(silent_s, now - self.heartbeat.last_reached, timeout_s)
        return reason if reason is not None or not self.fenced else "fenced"

    async def watch_fence(self, stop: asyncio.Event) -> None:
        loop = asyncio.get_running_loop()
        timeout_s = self.settings.node_timeout_s
        while not stop.is_set():
            await asyncio.sleep(FENCE_CHECK_S)
            now = loop.time()
            silent_s = now - self.heartbeat.last_ack
            reason = fence_reason(silent_s, now - self.heartbeat.last_reached, timeout_s)
            if reason is not None and not self.fenced:
                self.fence(reason)
            elif self.fenced and silent_s <= fence_bound_s(timeout_s):
                # A beat acknowledged since the fence (the bound, not the node
                # timeout: between the two a fenced agent unfenced at once).
                self.fenced = False
                self.logger.info(Event.AGENT_UNFENCED)
                self._report_fenced()

    def fence(self, reason: str) -> None:
        """Presumed lost: stop the trainer now; say so once NATS takes reports again."""
        self.fenced = True
        run = self.job
        message = (
            f"the agent on {self.node} fenced itself ({reason}): the control plane "
            "presumed the node lost, so it stopped the trainer; submit the job again"
        )
        self.logger.warning(Event.AGENT_FENCED, job_id=run.job_id if run else None, message=message)
        if run is None:
            return
        self._fenced_report = StatusReport(
            job_id=run.job_id,
            node=self.node,
            attempt=run.req.attempt,
            seq=run.reporter.seq + 1,
            time=dt.datetime.now(dt.UTC),
            state=JobState.FAILED,
            message=message,
            # The node was presumed lost: the job's cause, not its own.
            retryable=True,
        )
        # Not awaited here: the fence keeps watching while the group stops.
        self._fence_task = asyncio.create_task(
            run.stop(StopRequest.fenced(), self.cfg.cancel_grace_s + CANCEL_SLACK_S)
        )

    def _report_fenced(self) -> None:
        report, self._fenced_report = self._fenced_report, None
        if report is not None:
            self._tasks.append(asyncio.create_task(self._publish_fenced(report)))

    async def _publish_fenced(self, report: StatusReport) -> None:
        headers = {Header.MSG_ID: status_msg_id(report.job_id, report.attempt, report.seq)}
        subject = self.names.status(self.node, report.job_id)
        try:
            await self.js.publish(
                subject, encode(report), timeout=FENCED_REPORT_TIMEOUT_S, headers=headers
            )
        except Exception as e:
            self.logger.warning(Event.STATUS_DROPPED, job_id=report.job_id, error=repr(e))

    # --- shutdown -------------------------------------------------------------

    async def shutdown(self) -> None:
        run = self.job
        if run is not None:
            # Not the job's own failure: with attempts left it runs again elsewhere.
            await run.stop(
                StopRequest.agent_stopping(
                    f"the agent on {self.node} stopped while running this job: not the job's "
                    "own failure (a job with attempts left runs again); else submit it again"
                ),
                self.cfg.cancel_grace_s + CANCEL_SLACK_S,
            )
        with contextlib.suppress(Exception):
            # What KV delete publishes, without its bucket lookup (a stream
            # info request the node's credentials do not allow).
            await self.js.publish(
                self.names.node_heartbeat(self.node),
                b"",
                timeout=HEARTBEAT_DELETE_TIMEOUT_S,
                headers={Header.KV_OPERATION: KV_DEL},
            )


def answering(route: Route) -> Callable[[Msg], Awaitable[None]]:
    """A plain subscription's callback for `route`, through lorafleet.nats._micro's
    `endpoint()`: strict decoding, the same error replies as every service
    (Nats-Service-Error headers and the JSON error body).

    Not a micro service: micro also subscribes to `$SRV.>` (PING, INFO,
    STATS), which a node's credentials do not allow
    (lorafleet.access.permissions.agent_permissions); the server would refuse those
    subscriptions.
    """
    handle = endpoint(route.request_type, route.fn, route.subject)

    async def on_msg(msg: Msg) -> None:
        if not msg.reply:
            return  # nobody to answer: not a request
        await handle(Request(msg))

    return on_msg


async def clear_leftovers(cfg: AgentConfig) -> None:
    """No job survives a restart: what an earlier agent left running goes
    first, then its job directories."""
    logger = log.get(node=cfg.node)
    killed = await asyncio.to_thread(kill_leftover_trainers, cfg.work_dir)
    if killed:
        logger.warning(
            Event.TRAINER_KILLED,
            pids=killed,
            message="processes of jobs left by an earlier run of this agent",
        )
    removed = await asyncio.to_thread(remove_job_dirs, cfg.work_dir)
    if removed:
        logger.info(
            Event.JOB_DIR_REMOVED, jobs=removed, message="job directories left by an earlier run"
        )


def program(cfg: AgentConfig) -> runtime.Program:
    """The agent of `cfg.node` as a process (`runtime.main(program(cfg))`).

    Before it connects it clears what an earlier run left; a node's
    credentials may not create the JetStream layout, so it only tries.
    """

    async def make(nc: Client, settings: Settings) -> Agent:
        return Agent(nc, nc.jetstream(), settings, cfg)

    async def before_connect(_settings: Settings) -> None:
        await clear_leftovers(cfg)

    return runtime.Program(
        "agent",
        make,
        layout="if_allowed",
        before_connect=before_connect,
        client_name=f"lorafleet-agent-{cfg.node}",
        started_fields={
            "node": cfg.node,
            "trainer": cfg.trainer,
            "allow_cpu": cfg.allow_cpu,
            "work_dir": str(cfg.work_dir),
        },
    )
