"""structlog JSON logging with a fixed vocabulary of event names.

Dashboards (Grafana over Loki) select on `event` and on the field names
below, so both are fixed: add to them, never rename. Every line is one JSON
object on stderr with `timestamp` (ISO 8601, UTC), `level`, `service`,
`event`, and the event's fields (`job_id`, `node`, `state`, `loss`, `step`,
`steps`, `peak_mib`, `kind`, `size`, `sha256`, `message`, `error`).
"""

from __future__ import annotations

import logging
import sys
from typing import Any, Final

import stamina.instrumentation
import structlog


class Event:
    """Every event name a lorafleet process logs."""

    SERVICE_STARTED: Final = "service.started"
    SERVICE_STOPPED: Final = "service.stopped"
    REQUEST_FAILED: Final = "request.failed"
    NATS_DISCONNECTED: Final = "nats.disconnected"
    NATS_RECONNECTED: Final = "nats.reconnected"
    NATS_ERROR: Final = "nats.error"
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
    JOB_LOST: Final = "job.lost"
    TRANSITION_REFUSED: Final = "transition.refused"
    STATUS_REFUSED: Final = "status.refused"
    STATUS_STALE: Final = "status.stale"
    NODE_UP: Final = "node.up"
    NODE_LOST: Final = "node.lost"
    #: A node's agent stopped cleanly (it deleted its heartbeat key).
    NODE_LEFT: Final = "node.left"
    NODE_BUSY: Final = "node.busy"
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
    #: A generic back-off (stamina) is about to try again.
    RETRY_SCHEDULED: Final = "retry.scheduled"
    #: The scheduler cannot see the nodes bucket (its stream or its watcher
    #: does not answer): no node is judged lost while it lasts.
    WATCH_BLIND: Final = "watch.blind"
    #: The scheduler sees the nodes bucket again (`blind_s`: for how long it did not).
    WATCH_RESTORED: Final = "watch.restored"


def configure(service: str, level: str = "info", stream: Any = None) -> None:
    """Log JSON lines to `stream` (default stderr), each tagged with `service`."""
    logging.basicConfig(level=level.upper(), stream=stream or sys.stderr, format="%(message)s")
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            structlog.processors.JSONRenderer(),
        ],
        wrapper_class=structlog.make_filtering_bound_logger(
            logging.getLevelNamesMapping()[level.upper()]
        ),
        logger_factory=structlog.PrintLoggerFactory(stream or sys.stderr),
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


def get(**bound: Any) -> Any:
    """A logger; `bound` fields go on every line it writes."""
    return structlog.get_logger().bind(**bound)
