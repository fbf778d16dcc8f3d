"""The node's serving reports, published in order, each until acknowledged.

`report()` only queues (a load never waits on NATS); one task publishes
the queue in order to `<prefix>.status.<node>.<job>.serving` (the status
stream), each with the message id `<node>.serving.<seq>` so a retried
publish is stored once, and retried for `REPORT_TIMEOUT_S` before it is
dropped (logged: serving.report_dropped). `seq` is plan.ReportSeq:
per node, growing across restarts.
"""

from __future__ import annotations

import asyncio
import datetime as dt
from dataclasses import dataclass

import stamina
from nats.js import JetStreamContext

from lorafleet import log
from lorafleet.log import Event
from lorafleet.names import Header, Names
from lorafleet.nats._bus import encode
from lorafleet_schemas.messages import Engine, ServingReport, ServingState
from lorafleet_services.agent.serving.plan import ReportSeq

#: Seconds one serving report is retried for before it is dropped (logged).
REPORT_TIMEOUT_S = 60.0
#: Seconds one publish waits for its ack.
PUBLISH_TIMEOUT_S = 2.0


@dataclass(frozen=True, slots=True)
class Version:
    """Which adapter version a report is about."""

    job_id: str
    model: str
    served_name: str
    sha256: str


class ServingReporter:
    """Queues and publishes one node's ServingReports."""

    def __init__(self, js: JetStreamContext, names: Names, node: str) -> None:
        self.js = js
        self.names = names
        self.node = node
        self.seq = ReportSeq()
        self._queue: asyncio.Queue[ServingReport | None] = asyncio.Queue()
        self._task: asyncio.Task[None] | None = None
        self.logger = log.get(node=node)

    def start(self) -> None:
        self._task = asyncio.create_task(self._publish_all(), name="serving-reports")

    async def stop(self, timeout_s: float) -> None:
        """Publish what is queued, for at most `timeout_s`."""
        task, self._task = self._task, None
        if task is not None:
            self._queue.put_nowait(None)
            await asyncio.wait({task}, timeout=timeout_s)
            task.cancel()

    def report(
        self,
        v: Version,
        engine: str,
        state: ServingState,
        reason: str = "",
        *,
        lift: str = "",
        probe_error: float | None = None,
        kind: Engine = Engine.VLLM,
    ) -> None:
        report = ServingReport(
            job_id=v.job_id, node=self.node, engine=engine, engine_kind=kind, model=v.model,
            served_name=v.served_name, sha256=v.sha256, state=state, seq=self.seq.next(),
            time=dt.datetime.now(dt.UTC), reason=reason, lift=lift, probe_error=probe_error,
        )  # fmt: skip
        self.logger.info(Event.SERVING_CHANGED, job_id=v.job_id, served_name=v.served_name,
                         engine=engine, state=state, reason=reason, lift=lift)  # fmt: skip
        self._queue.put_nowait(report)

    async def _publish_all(self) -> None:
        while (report := await self._queue.get()) is not None:
            try:
                await self._publish(report)
            except Exception as e:
                self.logger.warning(Event.SERVING_REPORT_DROPPED, seq=report.seq, error=repr(e))

    async def _publish(self, report: ServingReport) -> None:
        subject = self.names.serving_report(self.node, report.job_id)
        headers = {Header.MSG_ID: f"{self.node}.serving.{report.seq}"}
        async for attempt in stamina.retry_context(
            on=Exception, attempts=None, timeout=REPORT_TIMEOUT_S, wait_initial=0.1, wait_max=2.0
        ):
            with attempt:
                await self.js.publish(
                    subject, encode(report), timeout=PUBLISH_TIMEOUT_S, headers=headers
                )
