"""The recorder's serving half, as plain async code: `api.adapters.list`, and
the serving reports the status consumer hands over (servings.py applies
them; this logs and publishes). RecorderApi holds one (`RecorderApi.serving`)
and gives it the one way job events go out (`send_event`, best effort:
the change is committed, a watcher that missed the event lists the records).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence

from lorafleet import log
from lorafleet.log import Event
from lorafleet_schemas.messages import AdapterList, AdapterListRequest, JobEvent, ServingReport
from lorafleet_services.recorder import servings
from lorafleet_services.recorder.db import Sessions

SendEvent = Callable[[str, JobEvent], Awaitable[None]]


class ServingApi:
    """The serving records' endpoint and report application, without a bus of its own."""

    def __init__(self, sm: Sessions, send_event: SendEvent) -> None:
        self.sm = sm
        self.send_event = send_event
        self.logger = log.get()

    async def adapters_list(self, req: AdapterListRequest) -> AdapterList:
        job_ids = [*req.job_ids, *([req.job_id] if req.job_id is not None else [])]
        records = await servings.list_records(
            self.sm, job_ids=job_ids, node=req.node, model=req.model, state=req.state,
            limit=req.limit, after=req.after,
        )  # fmt: skip
        return AdapterList(adapters=records)

    async def apply(self, reports: Sequence[ServingReport]) -> servings.ServingResult:
        """Apply a batch in one transaction; log refusals. Publish with `after`."""
        result = await servings.apply_reports(self.sm, reports)
        log.reports_refused(self.logger, result.refused, "serving report: ")
        for report in result.stale:
            self.logger.info(
                Event.STATUS_STALE,
                job_id=report.job_id,
                node=report.node,
                seq=report.seq,
                message="serving report older than the record",
            )
        return result

    async def after(self, result: servings.ServingResult) -> None:
        """Log and publish each serving record a committed batch changed."""
        for change in result.changes:
            record = change.serving
            self.logger.info(
                Event.SERVING_CHANGED,
                job_id=record.job_id,
                node=record.node,
                engine=record.engine,
                state=record.state.value,
                message=record.reason,
            )
            event = JobEvent(kind="serving", job=change.job, serving=record)
            await self.send_event(change.job.id, event)
