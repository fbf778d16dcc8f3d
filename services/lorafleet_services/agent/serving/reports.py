"""The node's serving reports, published in order, each until acknowledged.

`report()` only queues (a load never waits on NATS); an `OrderedPublisher`
(lorafleet/nats/_publisher.py) publishes the queue in order to
`<prefix>.status.<node>.<job>.serving` (the status stream), each under
`names.serving_msg_id` so a retried publish is stored once, and retried for
`REPORT_GIVE_UP_S` before it is dropped (logged: serving.report_dropped).
`seq` is plan.ReportSeq: per node, growing across restarts.
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass

from nats.js import JetStreamContext

from lorafleet import log
from lorafleet.log import Event
from lorafleet.names import Names, serving_msg_id
from lorafleet.nats._bus import encode
from lorafleet.nats._publisher import OrderedPublisher, Outgoing
from lorafleet_schemas.messages import Engine, ServingReport, ServingState
from lorafleet_services.agent.serving.plan import ReportSeq

#: Seconds one serving report is retried for before it is dropped (logged).
REPORT_GIVE_UP_S = 60.0


@dataclass(frozen=True, slots=True)
class AdapterVersion:
    """The adapter version a serving report is about: its job, the catalog
    model, the name engines serve it under, and its sha256."""

    job_id: str
    model: str
    served_name: str
    sha256: str


class ServingReporter:
    """Queues and publishes one node's ServingReports."""

    def __init__(self, js: JetStreamContext, names: Names, node: str) -> None:
        self.names = names
        self.node = node
        self.seq = ReportSeq()
        self.logger = log.get(node=node)
        self._publisher = OrderedPublisher(
            js, name="serving-reports", give_up_s=REPORT_GIVE_UP_S, on_dropped=self._dropped
        )

    def start(self) -> None:
        self._publisher.start()

    async def stop(self, timeout_s: float) -> None:
        """Publish what is queued, for at most `timeout_s`."""
        await self._publisher.stop(timeout_s)

    def _dropped(self, msg: Outgoing, error: Exception) -> None:
        self.logger.warning(Event.SERVING_REPORT_DROPPED, seq=msg.seq, error=repr(error))

    def report(
        self,
        v: AdapterVersion,
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
        subject = self.names.serving_report(self.node, report.job_id)
        msg_id = serving_msg_id(self.node, report.seq)
        self._publisher.put(Outgoing(subject, encode(report), msg_id, report.seq))
