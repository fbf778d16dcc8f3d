"""The recorder on NATS: micro endpoints and the durable status consumer.

Thin glue around api.RecorderApi. The status consumer is a durable pull
consumer (`names.recorder_consumer` on `names.status_stream`, explicit
ack): it fetches up to FETCH_BATCH reports, applies them in one
transaction, acks after commit and publishes job events after that. A
crash between commit and ack redelivers reports that the store then
applies as no-ops, so a SIGKILL at any point has no double effect. A
message that does not decode (poison) is logged and acked: redelivering it
would never help.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import os

import msgspec
import nats.errors
import nats.js.errors
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy
from nats.micro.service import Service
from sqlalchemy.ext.asyncio import AsyncEngine

import lorafleet
from lorafleet import bus, log
from lorafleet.log import Event
from lorafleet.names import Names
from lorafleet.service import start_service
from lorafleet.settings import Settings, SettingsError
from lorafleet_schemas.messages import StatusReport
from lorafleet_services.recorder import db
from lorafleet_services.recorder.api import RecorderApi

#: Reports fetched and applied in one transaction, at most.
FETCH_BATCH = 256
#: Seconds one fetch waits for the first report.
FETCH_TIMEOUT_S = 1.0
#: Seconds the server waits for an ack before redelivering; the environment
#: variable LORAFLEET_RECORDER_ACK_WAIT_S overrides it (fault tests use a few
#: seconds so that reports held by a killed recorder come back quickly).
ACK_WAIT_S = 30.0
ACK_WAIT_ENV = "LORAFLEET_RECORDER_ACK_WAIT_S"
#: Reports delivered and not yet acked, at most (a few batches' worth).
MAX_ACK_PENDING = 20_000
#: Seconds to wait before fetching again after a NATS or database error.
RETRY_PAUSE_S = 0.5
#: Seconds of idle fetching between checks that the durable consumer exists.
CONSUMER_CHECK_S = 10.0

_report_decoder = msgspec.json.Decoder(StatusReport)


class ObjectStoreDatasets:
    """The datasets bucket through nats-py's object store."""

    def __init__(self, js: JetStreamContext, bucket: str) -> None:
        self.js = js
        self.bucket = bucket

    async def put(self, name: str, content: bytes) -> None:
        obs = await self.js.object_store(self.bucket)
        with contextlib.suppress(nats.js.errors.ObjectNotFoundError):
            info = await obs.get_info(name)
            if info.size == len(content) and not info.deleted:
                return  # the name is the content's sha256: it is there already
        await obs.put(name, content)

    async def get(self, name: str) -> bytes | None:
        obs = await self.js.object_store(self.bucket)
        # writeinto: nats-py's plain get grows its buffer chunk by chunk
        # (quadratic in the object's size).
        buf = io.BytesIO()
        try:
            await obs.get(name, writeinto=buf)
        except (nats.js.errors.ObjectNotFoundError, nats.js.errors.ObjectDeletedError):
            return None
        return buf.getvalue()


def ack_wait_s() -> float:
    raw = os.environ.get(ACK_WAIT_ENV, "")
    try:
        value = float(raw) if raw else ACK_WAIT_S
    except ValueError:
        raise SettingsError(f"{ACK_WAIT_ENV}={raw!r} is not a number of seconds") from None
    if value <= 0:
        raise SettingsError(f"{ACK_WAIT_ENV} must be > 0 seconds")
    return value


def consumer_config(names: Names) -> ConsumerConfig:
    return ConsumerConfig(
        durable_name=names.recorder_consumer,
        filter_subject=names.status_subjects,
        ack_policy=AckPolicy.EXPLICIT,
        deliver_policy=DeliverPolicy.ALL,
        ack_wait=ack_wait_s(),
        max_ack_pending=MAX_ACK_PENDING,
        max_deliver=-1,
    )


class Recorder:
    """The recorder's endpoints and status consumer on one NATS connection."""

    def __init__(self, settings: Settings, nc: Client, engine: AsyncEngine) -> None:
        self.settings = settings
        self.names = settings.names
        self.nc = nc
        self.js = nc.jetstream()
        self.api = RecorderApi(
            db.sessions(engine),
            self.names,
            ObjectStoreDatasets(self.js, self.names.datasets_bucket),
            self._publish,
        )
        self.log = log.get()
        self._stop = asyncio.Event()
        self._service: Service | None = None
        self._consumer: asyncio.Task[None] | None = None
        self._sub: JetStreamContext.PullSubscription | None = None

    async def _publish(self, subject: str, payload: bytes) -> None:
        await self.nc.publish(subject, payload)

    async def start(self) -> None:
        """Ensure the JetStream layout, then serve requests and consume status."""
        await bus.ensure_layout(self.js, bus.layout_for(self.settings))
        self._sub = await self._subscribe()
        self._service = await start_service(
            self.nc,
            self.names.recorder_service,
            lorafleet.__version__,
            "lorafleet's system of record: jobs, catalog, loss curves",
            self.api.routes(),
            self.names.queue_group,
        )
        self._consumer = asyncio.create_task(self._consume())
        # The server knows the endpoints' subscriptions once this returns:
        # only then may `service.started` promise that requests are answered.
        await self.nc.flush()

    async def _subscribe(self) -> JetStreamContext.PullSubscription:
        return await self.js.pull_subscribe(
            self.names.status_subjects,
            durable=self.names.recorder_consumer,
            stream=self.names.status_stream,
            config=consumer_config(self.names),
        )

    async def stop(self) -> None:
        self._stop.set()
        if self._consumer is not None:
            await self._consumer
        if self._sub is not None:
            # A late fetch reply left in the subscription's queue would hold
            # up the connection's drain until it times out.
            with contextlib.suppress(Exception):
                await self._sub.unsubscribe()
        if self._service is not None:
            with contextlib.suppress(Exception):
                await self._service.stop()

    async def _ensure_consumer(self) -> None:
        """Re-create the durable consumer if it is gone (deleted, or a new server store).

        The new consumer replays the stream from its start; reports already
        applied change nothing, so that costs time, not correctness.
        """
        try:
            await self.js.consumer_info(self.names.status_stream, self.names.recorder_consumer)
            return
        except nats.js.errors.NotFoundError:
            pass
        except Exception:
            return  # the server is not answering yet: the next fetch error retries
        self.log.warning(
            Event.NATS_ERROR,
            error="the status consumer is gone",
            message="re-creating it; the status stream replays and changes nothing twice",
        )
        try:
            await bus.ensure_layout(self.js, bus.layout_for(self.settings))
            old, self._sub = self._sub, await self._subscribe()
        except Exception as e:
            self.log.warning(Event.NATS_ERROR, error=repr(e), where="status re-subscribe")
            return
        if old is not None:
            with contextlib.suppress(Exception):
                await old.unsubscribe()

    async def _consume(self) -> None:
        loop = asyncio.get_running_loop()
        last_check = loop.time()
        while not self._stop.is_set():
            assert self._sub is not None
            try:
                msgs = await self._sub.fetch(FETCH_BATCH, timeout=FETCH_TIMEOUT_S)
            except (TimeoutError, nats.errors.TimeoutError):
                # Idle: now and then make sure there is a consumer to idle on.
                if loop.time() - last_check >= CONSUMER_CHECK_S:
                    last_check = loop.time()
                    await self._ensure_consumer()
                continue
            except Exception as e:
                # Server restarting, connection re-establishing, consumer gone.
                self.log.warning(Event.NATS_ERROR, error=repr(e), where="status fetch")
                await asyncio.sleep(RETRY_PAUSE_S)
                await self._ensure_consumer()
                continue
            try:
                await self._apply(msgs)
            except Exception as e:
                # Unacked reports come back after the ack wait; nak them sooner.
                self.log.exception(Event.REQUEST_FAILED, error=repr(e), where="status apply")
                for m in msgs:
                    with contextlib.suppress(Exception):
                        await m.nak(delay=RETRY_PAUSE_S)
                await asyncio.sleep(RETRY_PAUSE_S)

    async def _apply(self, msgs: list[Msg]) -> None:
        reports: list[StatusReport] = []
        good: list[Msg] = []
        for m in msgs:
            try:
                reports.append(_report_decoder.decode(m.data))
                good.append(m)
            except msgspec.DecodeError as e:
                self.log.warning(
                    Event.STATUS_REFUSED, subject=m.subject, error=str(e), message="poison"
                )
                await m.ack()
        if not reports:
            return
        result = await self.api.apply_status(reports)
        for m in good:
            await m.ack()
        await self.api.after_status(result)


async def run(settings: Settings, stop: asyncio.Event) -> None:
    """Migrate, connect, serve until `stop` is set, then drain (runtime.main's contract)."""
    logger = log.get()
    url = settings.effective_database_url
    await asyncio.to_thread(db.migrate, url)
    engine = db.create_engine(url)
    nc = await bus.connect(settings, "lorafleet-recorder")
    recorder = Recorder(settings, nc, engine)
    try:
        await recorder.start()
        logger.info(Event.SERVICE_STARTED, version=lorafleet.__version__)
        await stop.wait()
    finally:
        await recorder.stop()
        await bus.drain_quietly(nc)
        await engine.dispose()
        logger.info(Event.SERVICE_STOPPED)
