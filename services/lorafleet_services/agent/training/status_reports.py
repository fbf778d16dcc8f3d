"""A job's status reports, published in order, each until acknowledged.

One `Reporter` per job and attempt: `report()` only queues (the trainer's
stdout is never blocked on NATS; the trainer would stall on a full pipe),
and one publisher task publishes the queue in order. Each report is a
JetStream publish, awaited for its ack and retried on failure (stamina,
PUBLISH_RETRY_FIRST_S doubling to PUBLISH_RETRY_MAX_S, no limit but the
caller's drain timeout and the fence), with the message id
`<job>.<attempt>.<seq>` so a retry is stored once.
"""

from __future__ import annotations

import asyncio
import datetime as dt
from typing import Any

import stamina
from nats.js import JetStreamContext

from lorafleet import log
from lorafleet.log import Event
from lorafleet.names import Header, Names
from lorafleet.nats._bus import encode
from lorafleet_schemas.messages import JobState, StartRequest, StatusReport
from lorafleet_services.agent.metric_views import RUNNING_JOBS

#: Seconds one status publish waits for its ack before it is retried.
PUBLISH_TIMEOUT_S = 2.0
#: First and longest pause between retries of a status publish; seconds.
PUBLISH_RETRY_FIRST_S = 0.1
PUBLISH_RETRY_MAX_S = 2.0


class Reporter:
    """The job's status reports, published in order, each until acknowledged."""

    def __init__(self, js: JetStreamContext, names: Names, node: str, req: StartRequest) -> None:
        self.js = js
        self.subject = names.status(node, req.job_id)
        self.node = node
        self.job_id = req.job_id
        self.attempt = req.attempt
        self.seq = 0
        self.published = 0
        self._queue: asyncio.Queue[StatusReport | None] = asyncio.Queue()
        self._task = asyncio.create_task(self._publish_all())
        self.logger = log.get(node=node, job_id=req.job_id)

    def report(self, state: JobState | None = None, message: str = "", **fields: Any) -> None:
        self.seq += 1
        RUNNING_JOBS.report(self.node, self.job_id, fields)
        self._queue.put_nowait(
            StatusReport(
                job_id=self.job_id,
                node=self.node,
                attempt=self.attempt,
                seq=self.seq,
                time=dt.datetime.now(dt.UTC),
                state=state,
                message=message,
                **fields,
            )
        )

    async def _publish_all(self) -> None:
        while (report := await self._queue.get()) is not None:
            await self._publish(report)
            self.published = report.seq

    async def _publish(self, report: StatusReport) -> None:
        """Publish until acknowledged: no limit here, the job's drain timeout
        and the fence bound it."""
        payload = encode(report)
        headers = {Header.MSG_ID: f"{self.job_id}.{self.attempt}.{report.seq}"}
        async for attempt in stamina.retry_context(
            on=Exception,
            attempts=None,
            timeout=None,
            wait_initial=PUBLISH_RETRY_FIRST_S,
            wait_max=PUBLISH_RETRY_MAX_S,
            wait_jitter=0,
        ):
            with attempt:
                try:
                    await self.js.publish(
                        self.subject, payload, timeout=PUBLISH_TIMEOUT_S, headers=headers
                    )
                except Exception as e:
                    self.logger.warning(Event.STATUS_RETRY, seq=report.seq, error=repr(e))
                    raise

    async def stop(self, timeout_s: float | None = None) -> None:
        """Publish what is queued (at most `timeout_s` seconds; None: until done)."""
        self._queue.put_nowait(None)
        await asyncio.wait({self._task}, timeout=timeout_s)
        self.abandon()

    def abandon(self) -> None:
        """Drop what is not published yet (fenced: no one is listening for it)."""
        if not self._task.done():
            self._task.cancel()
            self.logger.warning(Event.STATUS_DROPPED, dropped=self.seq - self.published)
