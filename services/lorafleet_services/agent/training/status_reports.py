"""A job's status reports, published in order, each until acknowledged.

One `Reporter` per job and attempt: `report()` only queues (the trainer's
stdout is never blocked on NATS; the trainer would stall on a full pipe),
and its `OrderedPublisher` (lorafleet/nats/_publisher.py) publishes the
queue in order, each report retried until acknowledged (no limit but the
caller's drain timeout and the fence) under `names.status_msg_id`, so a
retry is stored once.
"""

from __future__ import annotations

import datetime as dt
from typing import Any

from nats.js import JetStreamContext

from lorafleet import log
from lorafleet.log import Event
from lorafleet.names import Names, status_msg_id
from lorafleet.nats._bus import encode
from lorafleet.nats._publisher import OrderedPublisher, Outgoing
from lorafleet_schemas.messages import JobState, StartRequest, StatusReport
from lorafleet_services.agent.metric_views import RUNNING_JOBS


class Reporter:
    """The job's status reports, published in order, each until acknowledged."""

    def __init__(self, js: JetStreamContext, names: Names, node: str, req: StartRequest) -> None:
        self.subject = names.status(node, req.job_id)
        self.node = node
        self.job_id = req.job_id
        self.attempt = req.attempt
        self.seq = 0
        self.logger = log.get(node=node, job_id=req.job_id)
        self._publisher = OrderedPublisher(js, name=f"status-{req.job_id}", on_retry=self._retry)
        self._publisher.start()

    def report(self, state: JobState | None = None, message: str = "", **fields: Any) -> None:
        self.seq += 1
        RUNNING_JOBS.report(self.node, self.job_id, fields)
        report = StatusReport(
            job_id=self.job_id,
            node=self.node,
            attempt=self.attempt,
            seq=self.seq,
            time=dt.datetime.now(dt.UTC),
            state=state,
            message=message,
            **fields,
        )
        msg_id = status_msg_id(self.job_id, self.attempt, self.seq)
        self._publisher.put(Outgoing(self.subject, encode(report), msg_id, self.seq))

    def _retry(self, msg: Outgoing, error: Exception) -> None:
        self.logger.warning(Event.STATUS_RETRY, seq=msg.seq, error=repr(error))

    async def stop(self, timeout_s: float | None = None) -> None:
        """Publish what is queued (at most `timeout_s` seconds; None: until done)."""
        self._dropped(await self._publisher.stop(timeout_s))

    def abandon(self) -> None:
        """Drop what is not published yet (fenced: no one is listening for it)."""
        self._dropped(self._publisher.abandon())

    def _dropped(self, unpublished: int) -> None:
        if unpublished:
            self.logger.warning(Event.STATUS_DROPPED, dropped=unpublished)
