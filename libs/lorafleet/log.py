"""structlog logging with a fixed vocabulary of event names.

Dashboards (Grafana over Loki) select on `event` and on the field names
below, so both are fixed: add to them, never rename. Every line is one JSON
object on stderr with `timestamp` (ISO 8601, UTC), `level`, `service`,
`event`, and the event's fields (`job_id`, `node`, `state`, `loss`, `step`,
`steps`, `peak_mib`, `kind`, `size`, `sha256`, `message`, `error`).

On a terminal the same events and fields are rendered for a person instead:
one coloured line each, the process named first (structlog's console
renderer). LORAFLEET_LOG_FORMAT=json or =console overrides the guess;
`ConsoleLines` renders JSON lines a child process wrote the same way (what
`lorafleet up` shows of its services).
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import os
import queue
import sys
import threading
from collections.abc import Iterable, MutableMapping
from typing import Any, Final, Literal, TextIO

import stamina.instrumentation
import structlog


class Event:
    """Every event name a lorafleet process logs."""

    SERVICE_STARTED: Final = "service.started"
    SERVICE_STOPPED: Final = "service.stopped"
    REQUEST_FAILED: Final = "request.failed"
    #: The recorder's database did not answer at start; it tries again
    #: (recorder/db.py, `Settings.database_wait_s`).
    DATABASE_WAITING: Final = "database.waiting"
    NATS_DISCONNECTED: Final = "nats.disconnected"
    NATS_RECONNECTED: Final = "nats.reconnected"
    NATS_ERROR: Final = "nats.error"
    #: A JetStream step of a service's start met a cluster between leaders;
    #: it tries again (lorafleet/nats/_bus.py, `when_cluster_answers`).
    NATS_WAITING: Final = "nats.waiting"
    #: The agent left a server that answers but stores no beat (it may be cut
    #: off from the rest of the cluster) for another (agent/heartbeat.py).
    NATS_MOVED: Final = "nats.moved"
    #: The server refused a publish or subscription for want of permission.
    NATS_REFUSED: Final = "nats.refused"
    MODEL_ADDED: Final = "model.added"
    JOB_QUEUED: Final = "job.queued"
    JOB_DISPATCHED: Final = "job.dispatched"
    JOB_WAITING: Final = "job.waiting"
    JOB_STATE: Final = "job.state"
    JOB_PROGRESS: Final = "job.progress"
    JOB_EVAL: Final = "job.eval"
    JOB_FINISHED: Final = "job.finished"
    JOB_CANCELLED: Final = "job.cancelled"
    #: A final job's record was deleted (api.jobs.delete: `job_id`, `reason`);
    #: retention removes what only it needed.
    JOB_DELETED: Final = "job.deleted"
    JOB_LOST: Final = "job.lost"
    #: A job went back to the queue: lost not by its own fault with attempts
    #: left (the control plane's requeue), or resumed by hand (api.jobs.resume).
    JOB_REQUEUED: Final = "job.requeued"
    #: A `starting` job its live node does not run was sent its start again
    #: (same attempt): the start may never have reached the node.
    JOB_RESENT: Final = "job.resent"
    #: The recorder took a job's newer checkpoint (JobRecord.checkpoint).
    JOB_CHECKPOINT: Final = "job.checkpoint"
    #: A checkpoint after the next step was asked of a job's trainer (its node
    #: drained with its training moved: it resumes elsewhere from it).
    JOB_CHECKPOINT_ASKED: Final = "job.checkpoint_asked"
    #: The agent paused its trainer for the node's engines, or let it go on
    #: (agent/training/yielding.py).
    JOB_YIELD: Final = "job.yield"
    TRANSITION_REFUSED: Final = "transition.refused"
    STATUS_REFUSED: Final = "status.refused"
    STATUS_STALE: Final = "status.stale"
    NODE_UP: Final = "node.up"
    NODE_LOST: Final = "node.lost"
    #: A node's key went away (deleted or expired) while the scheduler's view
    #: was blind or just back: not a loss, and not logged as one; the sweep
    #: judges the node from now on (scheduler/nodes.py).
    NODE_DEPARTURE_DEFERRED: Final = "node.departure_deferred"
    #: A node's agent stopped cleanly (it deleted its heartbeat key).
    NODE_LEFT: Final = "node.left"
    NODE_BUSY: Final = "node.busy"
    #: An operator cordoned, drained or uncordoned a node (`node`, `state`).
    NODE_MARKED: Final = "node.marked"
    #: The leader asked a node to load or unload a placed replica (`job_id`,
    #: `node`, `state`: place or unplace, `message`: the agent's answer).
    REPLICA_PLACED: Final = "replica.placed"
    #: A reader paged through a listing as far as it may (a replica pass's
    #: done jobs, MAX_PLACED_PAGES; the gateway's served adapters,
    #: MAX_SERVED_PAGES) and went on with what it read: `message` says which
    #: listing and what was left out.
    LISTING_CAPPED: Final = "listing.capped"
    LEADER_ACQUIRED: Final = "leader.acquired"
    LEADER_LOST: Final = "leader.lost"
    TRAINER_STARTED: Final = "trainer.started"
    TRAINER_LINE: Final = "trainer.line"
    TRAINER_EXITED: Final = "trainer.exited"
    TRAINER_KILLED: Final = "trainer.killed"
    OVERLAY_INSTALLED: Final = "overlay.installed"
    CONVERSION_FETCHED: Final = "conversion.fetched"
    AGENT_FENCED: Final = "agent.fenced"
    AGENT_UNFENCED: Final = "agent.unfenced"
    HEARTBEAT_FAILED: Final = "heartbeat.failed"
    HEARTBEAT_SLOW: Final = "heartbeat.slow"
    NODE_NO_CARDS: Final = "node.no_cards"
    TRAINER_LINE_BAD: Final = "trainer.line_bad"
    STATUS_RETRY: Final = "status.retry"
    STATUS_DROPPED: Final = "status.dropped"
    JOB_ACCEPTED: Final = "job.accepted"
    JOB_REFUSED: Final = "job.refused"
    JOB_FAILED: Final = "job.failed"
    JOB_DIR_REMOVED: Final = "job.dir_removed"
    ARTIFACT_CHUNK: Final = "artifact.chunk"
    ARTIFACT_STORED: Final = "artifact.stored"
    ARTIFACT_REJECTED: Final = "artifact.rejected"
    ARTIFACT_DELIVERED: Final = "artifact.delivered"
    #: A durable consumer's settings (ack wait, max ack pending) were brought
    #: to this process's: the server keeps a consumer's settings from its creation.
    CONSUMER_UPDATED: Final = "consumer.updated"
    #: A batch was in hand past its consumer's max_hold_s: no longer kept from
    #: redelivery (a stuck handler's messages go back to the stream).
    CONSUMER_HOLD_EXPIRED: Final = "consumer.hold_expired"
    #: A generic back-off (stamina) is about to try again.
    RETRY_SCHEDULED: Final = "retry.scheduled"
    #: Collecting metrics for a scrape failed in part (lorafleet.metrics).
    METRICS_FAILED: Final = "metrics.failed"
    #: The scheduler cannot see the nodes bucket (its stream or its watcher
    #: does not answer): no node is judged lost while it lasts.
    WATCH_BLIND: Final = "watch.blind"
    #: The scheduler sees the nodes bucket again (`blind_s`: for how long it did not).
    WATCH_RESTORED: Final = "watch.restored"
    #: The gateway's HTTP port is bound and answering (`url`, `engines`).
    GATEWAY_LISTENING: Final = "gateway.listening"
    #: The gateway answered an HTTP request with an error (`status`, `path`, `client`).
    GATEWAY_REFUSED: Final = "gateway.refused"
    #: A node's heartbeat key went (`node`): the gateway dropped its routes.
    GATEWAY_NODE_GONE: Final = "gateway.node_gone"
    #: The gateway retried a request on another replica (`engine`: the one that
    #: failed before its first byte, `error`).
    GATEWAY_RETRIED: Final = "gateway.retried"
    #: An engine the gateway routes to did not list its models (`engine`, `error`).
    GATEWAY_ENGINE_UNAVAILABLE: Final = "gateway.engine_unavailable"
    #: The gateway took a file (`file_id`, `bytes`, `records`, `client`).
    GATEWAY_FILE_STORED: Final = "gateway.file_stored"
    #: The gateway deleted a file object (`file_id`, `client`); its data goes by
    #: retention once nothing names it.
    GATEWAY_FILE_DELETED: Final = "gateway.file_deleted"
    #: Retention removed an object nothing needs (`bucket`, `object`, `kind`,
    #: `size`, `reason`, `job_id`).
    RETENTION_REMOVED: Final = "retention.removed"
    #: A retention run ended (`bucket`, `dry_run`, `examined`, `removed`,
    #: `freed_bytes`, `waiting`: unneeded, in their grace).
    RETENTION_SWEPT: Final = "retention.swept"
    #: A retention run removed nothing at all, and why (`bucket`, `error`).
    RETENTION_REFUSED: Final = "retention.refused"
    #: A serving record changed: the agent's report of it (`served_name`,
    #: `engine`, `state`, `reason`), the recorder's commit of it (`job_id`,
    #: `node`, `engine`, `state`, `message`: its reason).
    SERVING_CHANGED: Final = "serving.changed"
    #: The scheduler answered `adapters.serve`/`unserve` (`job_id`, `node`,
    #: `outcome`: sent, refused, unanswered; `message`).
    SERVE_REQUESTED: Final = "serve.requested"
    #: A serving report could not be published in its bound (`seq`, `error`).
    SERVING_REPORT_DROPPED: Final = "serving.report_dropped"
    #: Reading the running engines failed (`error`); the last read stands.
    ENGINES_READ_FAILED: Final = "engines.read_failed"


#: The environment variable that picks the log format: "json" or "console".
LOG_FORMAT_ENV: Final = "LORAFLEET_LOG_FORMAT"
LogFormat = Literal["json", "console"]
LOG_FORMATS: Final = ("json", "console")


class LogFormatError(ValueError):
    """LORAFLEET_LOG_FORMAT holds something other than json or console."""


def log_format(stream: Any, env: MutableMapping[str, str] | None = None) -> LogFormat:
    """LORAFLEET_LOG_FORMAT when set; else console on a terminal, JSON otherwise."""
    value = (os.environ if env is None else env).get(LOG_FORMAT_ENV, "").strip().lower()
    if value == "json":
        return "json"
    if value == "console":
        return "console"
    if value:
        raise LogFormatError(f"{LOG_FORMAT_ENV}={value!r}: set it to json or console")
    isatty = getattr(stream, "isatty", None)
    return "console" if isatty is not None and isatty() else "json"


def _for_a_person(_logger: Any, _name: str, event: MutableMapping[str, Any]) -> Any:
    # The console renderer shows `logger_name` in brackets before the fields:
    # the process. The time of day (UTC, to the ms) is what a person scans for.
    if "service" in event:
        event["logger_name"] = event.pop("service")
    stamp = event.get("timestamp")
    if isinstance(stamp, str) and len(stamp) >= 23 and stamp[10] == "T":
        event["timestamp"] = stamp[11:23] + "Z"
    return event


def console_renderer(colors: bool) -> structlog.dev.ConsoleRenderer:
    return structlog.dev.ConsoleRenderer(colors=colors, pad_event_to=24, sort_keys=False)


def configure(
    service: str, level: str = "info", stream: Any = None, fmt: LogFormat | None = None
) -> None:
    """Log to `stream` (default stderr), each line tagged with `service`: JSON
    lines, or console lines for a person (`fmt`, default `log_format(stream)`)."""
    stream = stream or sys.stderr
    fmt = fmt or log_format(stream)
    logging.basicConfig(level=level.upper(), stream=stream, format="%(message)s")
    render: list[Any] = [structlog.processors.JSONRenderer()]
    if fmt == "console":
        render = [_for_a_person, console_renderer(colors=_isatty(stream))]
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            *render,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(
            logging.getLevelNamesMapping()[level.upper()]
        ),
        logger_factory=structlog.PrintLoggerFactory(stream),
        cache_logger_on_first_use=False,
    )
    structlog.contextvars.bind_contextvars(service=service)
    # stamina would log its own `stamina.retry_scheduled`, outside the vocabulary.
    stamina.instrumentation.set_on_retry_hooks([_log_retry])


def _log_retry(details: stamina.instrumentation.RetryDetails) -> None:
    get().warning(
        Event.RETRY_SCHEDULED,
        message=f"{details.name}: try {details.retry_num + 1} in {details.wait_for:.2f} s",
        error=repr(details.caused_by),
    )


def reports_refused(logger: Any, refused: Iterable[tuple[Any, str]], about: str = "") -> None:
    """`status.refused` for each (report, why) a batch refused: the job, node
    and sequence of the report (a StatusReport or a ServingReport) and why,
    after `about` ("serving report: ")."""
    for report, why in refused:
        logger.warning(
            Event.STATUS_REFUSED,
            job_id=report.job_id,
            node=report.node,
            seq=report.seq,
            message=about + why,
        )


def get(**bound: Any) -> Any:
    """A logger; `bound` fields go on every line it writes."""
    return structlog.get_logger().bind(**bound)


def _isatty(stream: Any) -> bool:
    isatty = getattr(stream, "isatty", None)
    return bool(isatty is not None and isatty())


class ConsoleLines(io.TextIOBase):
    """A text stream that writes each JSON log line it is given to `out` as a
    console line (same event, same fields); other text passes through."""

    def __init__(self, out: TextIO) -> None:
        super().__init__()
        self.out = out
        self.renderer = console_renderer(colors=_isatty(out))
        self._partial = ""

    def write(self, text: str) -> int:
        *lines, self._partial = (self._partial + text).split("\n")
        for line in lines:
            self.out.write(self.render(line) + "\n")
        return len(text)

    def render(self, line: str) -> str:
        try:
            obj = json.loads(line)
        except ValueError:
            return line
        if not isinstance(obj, dict) or "event" not in obj:
            return line
        level = str(obj.get("level", "info"))
        return str(self.renderer(None, level, _for_a_person(None, level, obj)))

    def flush(self) -> None:
        self.out.flush()


#: Lines `BackgroundLines` holds for a terminal that falls behind, at most.
BACKGROUND_MAX_LINES = 10_000
#: Seconds `BackgroundLines.close` gives its thread to write what it holds.
BACKGROUND_CLOSE_S = 5.0


class BackgroundLines(io.TextIOBase):
    """A text stream whose writes never wait: each goes into a bounded queue
    that a thread writes to `out`. `lorafleet up` copies its services' log
    lines to a person's terminal; one that falls behind (tmux under load, a
    slow SSH link, a paused scroll) made the copy wait, then every service's
    log pipe fill, then the services' own event loops wait on their log
    writes: an agent's heartbeats stopped for 3 s and its node was judged
    lost. Past `max_lines` waiting, lines are dropped and counted, and the
    next line written says how many."""

    def __init__(self, out: TextIO | io.TextIOBase, max_lines: int = BACKGROUND_MAX_LINES) -> None:
        super().__init__()
        self.out = out
        self._lines: queue.Queue[str | None] = queue.Queue(max_lines)
        self._dropped = 0
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._copy, name="background-lines", daemon=True)
        self._thread.start()

    def write(self, text: str) -> int:
        try:
            self._lines.put_nowait(text)
        except queue.Full:
            with self._lock:
                self._dropped += 1
        return len(text)

    def flush(self) -> None:
        """Nothing to wait for: the thread flushes `out` after each line."""

    def close(self) -> None:
        """Write what is held (within BACKGROUND_CLOSE_S), then stop the thread."""
        if self._thread.is_alive():
            with contextlib.suppress(queue.Full):
                self._lines.put(None, timeout=BACKGROUND_CLOSE_S)
            self._thread.join(BACKGROUND_CLOSE_S)
        super().close()

    def _copy(self) -> None:
        while (text := self._lines.get()) is not None:
            with self._lock:
                dropped, self._dropped = self._dropped, 0
            try:
                if dropped:
                    self.out.write(f"... {dropped} log lines dropped: the terminal fell behind\n")
                self.out.write(text)
                self.out.flush()
            except (OSError, ValueError):  # the terminal went away: nobody to copy to
                return
