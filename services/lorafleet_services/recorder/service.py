"""The recorder on NATS: micro endpoints and the durable status consumer.

Thin glue around api.RecorderApi. The status consumer is the one pull
loop of lorafleet.nats._consumer (`names.recorder_consumer` on
`names.status_stream`): it hands over up to REPORT_FETCH_BATCH reports at a time,
which are applied in one transaction, acked after commit, and the job
events published after that. A crash between commit and ack redelivers
reports that the store then applies as no-ops, so a SIGKILL at any point
has no double effect. A message that does not decode, or holds a NUL in a
text (which PostgreSQL cannot store), is poison: logged and acked, as
redelivering it would never help.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import io
from collections.abc import Callable

import msgspec
import nats.js.errors
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.micro.service import Service
from sqlalchemy.ext.asyncio import AsyncEngine

import lorafleet
from lorafleet import _runtime as runtime
from lorafleet import log, metrics
from lorafleet._tasks import stop_tasks
from lorafleet.access.permissions import owned_layout_parts
from lorafleet.log import Event
from lorafleet.nats import _bus as bus
from lorafleet.nats._consumer import PullConsumer, PullConsumerConfig
from lorafleet.nats._micro import Route, start_service
from lorafleet.nats._natspy import download_object
from lorafleet.objects import touch_object
from lorafleet.retention._sweep import RetentionSweep, wall_now
from lorafleet.retention.rules import Policy
from lorafleet.settings import Settings
from lorafleet_schemas.messages import GcReport, GcRequest, ServingReport, StatusReport
from lorafleet_services.recorder import db, servings, store
from lorafleet_services.recorder.api import RecorderApi, nul_at
from lorafleet_services.recorder.metric_views import JobCounts
from lorafleet_services.recorder.retention import DatasetJudge

#: Reports fetched and applied in one transaction, at most.
REPORT_FETCH_BATCH = 256
#: Seconds one fetch waits for the first report when none is there (with
#: reports in the stream a fetch returns at once). `stop()` lets the fetch in
#: flight end, so this is also what a clean stop waits at most.
FETCH_WAIT_S = 0.25
#: Reports delivered and not yet acked, at most (a few batches' worth).
REPORT_MAX_ACK_PENDING = 20_000

_report_decoder = msgspec.json.Decoder(StatusReport)
_serving_decoder = msgspec.json.Decoder(ServingReport)
_Decoder = msgspec.json.Decoder[StatusReport] | msgspec.json.Decoder[ServingReport]


class ObjectStoreDatasets:
    """The datasets bucket through nats-py's object store."""

    def __init__(self, js: JetStreamContext, bucket: str) -> None:
        self.js = js
        self.bucket = bucket

    async def put(self, name: str, content: bytes) -> None:
        # The name is the content's sha256: a stored one is this data already,
        # touched so that a retention sweep that judged it keeps it.
        if await touch_object(self.js, self.bucket, name):
            return
        obs = await self.js.object_store(self.bucket)
        await obs.put(name, content)

    async def touch(self, name: str) -> bool:
        return await touch_object(self.js, self.bucket, name)

    async def get(self, name: str) -> bytes | None:
        buf = io.BytesIO()
        try:
            await download_object(self.js, self.bucket, name, buf)
        except (nats.js.errors.ObjectNotFoundError, nats.js.errors.ObjectDeletedError):
            return None
        return buf.getvalue()


def consumer_config(settings: Settings) -> PullConsumerConfig:
    """The status consumer; the ack wait is `settings.recorder_ack_wait_s`."""
    names = settings.names
    return PullConsumerConfig(
        stream=names.status_stream,
        durable=names.recorder_consumer,
        filter_subject=names.status_subjects,
        ack_wait_s=settings.recorder_ack_wait_s,
        max_ack_pending=REPORT_MAX_ACK_PENDING,
        batch=REPORT_FETCH_BATCH,
        fetch_wait_s=FETCH_WAIT_S,
    )


class Recorder:
    """The recorder's endpoints and status consumer on one NATS connection.

    `start()`, then `stop()`; the recorder owns `engine` and disposes it at stop.
    """

    def __init__(self, settings: Settings, nc: Client, engine: AsyncEngine) -> None:
        self.settings = settings
        self.names = settings.names
        self.nc = nc
        self.engine = engine
        self.js = nc.jetstream()
        self.api = RecorderApi(
            db.sessions(engine),
            self.names,
            ObjectStoreDatasets(self.js, self.names.datasets_bucket),
            self._publish,
        )
        policy = Policy.of(settings)
        self.retention = RetentionSweep(
            self.js, self.names.datasets_bucket,
            DatasetJudge(self.js, self.names, self.api.sm, policy, wall_now), policy,
        )  # fmt: skip
        self._retention_task: asyncio.Task[None] | None = None
        self.logger = log.get()
        self._service: Service | None = None
        self._unregister: Callable[[], None] | None = None
        self.job_counts = JobCounts()
        self._consumer = PullConsumer(
            self.js, consumer_config(settings), self._apply, ensure_stream=self._ensure_layout
        )

    async def _publish(self, subject: str, payload: bytes) -> None:
        await self.nc.publish(subject, payload)

    async def _ensure_layout(self) -> None:
        parts = owned_layout_parts(self.settings.nats_nkey_seed, PROGRAM.name)
        await bus.ensure_layout(self.js, bus.layout_for(self.settings), parts)

    async def start(self) -> None:
        """Consume status and serve requests (the JetStream layout exists: runtime.serve)."""
        await bus.when_cluster_answers("the recorder's status consumer", self._consumer.start)
        self._unregister = metrics.LIVE.add(self.job_counts.samples, self._count_jobs)
        self._service = await start_service(
            self.nc,
            self.names.recorder_service,
            lorafleet.__version__,
            "lorafleet's system of record: jobs, catalog, loss curves",
            [*self.api.routes(), Route(self.names.datasets_gc, GcRequest, self.gc)],
            self.names.queue_group,
        )
        if self.settings.retention_sweep_every_s > 0:
            self._retention_task = asyncio.create_task(
                self.retention.every(self.settings.retention_sweep_every_s)
            )
        # The server knows the endpoints' subscriptions once this returns:
        # only then may `service.started` promise that requests are answered.
        await self.nc.flush()

    async def gc(self, req: GcRequest) -> GcReport:
        """`api.datasets.gc`: one retention run of the datasets bucket."""
        return await self.retention.run(req.dry_run)

    async def stop(self) -> None:
        """Stop consuming and answering, then close the database engine (owned here)."""
        await stop_tasks(self._retention_task)
        await self._consumer.stop()
        if self._unregister is not None:
            self._unregister()
        if self._service is not None:
            with contextlib.suppress(Exception):
                await self._service.stop()
        await self.engine.dispose()

    async def _count_jobs(self) -> None:
        """Jobs and serving records by state for the metrics endpoint (a query each per scrape)."""
        counts, oldest = await store.job_counts(self.api.sm)
        age_s = (dt.datetime.now(dt.UTC) - oldest).total_seconds() if oldest else 0.0
        self.job_counts.set(counts, age_s, await servings.state_counts(self.api.sm))

    async def _apply(self, msgs: list[Msg]) -> None:
        """Apply a batch: status reports and serving reports (told apart by
        subject), each kind in one transaction; ack after both commit, then
        publish."""
        reports: list[StatusReport] = []
        served: list[ServingReport] = []
        good: list[Msg] = []
        for m in msgs:
            serving = self.names.is_serving_report(m.subject)
            decoded = await self._decoded(m, _serving_decoder if serving else _report_decoder)
            if isinstance(decoded, ServingReport):
                served.append(decoded)
            elif isinstance(decoded, StatusReport):
                reports.append(decoded)
            else:
                continue
            good.append(m)
        if not good:
            return
        result = await self.api.apply_status(reports) if reports else None
        serving_result = await self.api.serving.apply(served) if served else None
        for m in good:
            await m.ack()
        if result is not None:
            await self.api.after_status(result)
        if serving_result is not None:
            await self.api.serving.after(serving_result)

    async def _decoded(self, m: Msg, decoder: _Decoder) -> StatusReport | ServingReport | None:
        """The report `m` holds; None for poison (logged and acked here)."""
        try:
            report = decoder.decode(m.data)
        except msgspec.DecodeError as e:
            self.logger.warning(
                Event.STATUS_REFUSED, subject=m.subject, error=str(e), message="poison"
            )
            await m.ack()
            return None
        # JSON carries a NUL only escaped: most reports skip the walk.
        nul = nul_at(report) if b"\\u0000" in m.data else None
        if nul is not None:
            # PostgreSQL would refuse the whole batch, every redelivery.
            self.logger.warning(
                Event.STATUS_REFUSED, subject=m.subject, error=f"a NUL at {nul}", message="poison"
            )
            await m.ack()
            return None
        return report


async def migrate(settings: Settings) -> None:
    """Bring the database to the newest schema once it answers (waiting
    `settings.database_wait_s`), before connecting: its errors stay plain."""
    await db.migrate_when_up(settings.effective_database_url, settings.database_wait_s)


async def make(nc: Client, settings: Settings) -> Recorder:
    return Recorder(settings, nc, db.create_engine(settings.effective_database_url))


#: How `runtime.serve` runs the recorder (its NATS client is "lorafleet-recorder").
PROGRAM = runtime.Program("recorder", make, before_connect=migrate)
