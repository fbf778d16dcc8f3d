"""The artifact-store: assembles chunked deliveries into whole, verified objects.

The pieces, each in its own module (DESIGN.md says why it stays exact when
killed at any moment):

- `assembly`: chunks put in order and verified, the delivery rules (plain code);
- `delivery`: the delivery state machine (opened, read back, taken,
  finished, failed, discarded, dropped);
- `streams`: the JetStream I/O it needs (the artifacts stream, the object store);
- `sweeper`: orphaned object chunks of a dead store, deliveries gone idle;
- `api`: `api.artifacts.list/get`.

This module wires them to the durable pull consumer and runs the process.
"""

from __future__ import annotations

import asyncio
import contextlib
import os

import nats.aio.client
import nats.errors
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

from lorafleet import log
from lorafleet.artifacts import AsyncPublisher
from lorafleet.bus import connect, drain_quietly, ensure_layout, layout_for
from lorafleet.log import Event
from lorafleet.names import Names
from lorafleet.recorder_client import RecorderClient
from lorafleet.service import start_service
from lorafleet.settings import Settings, SettingsError
from lorafleet_services.artifact_store.api import ArtifactApi
from lorafleet_services.artifact_store.delivery import RETRY_DELAY_S, Deliveries
from lorafleet_services.artifact_store.streams import Streams
from lorafleet_services.artifact_store.sweeper import IDLE_CHECK_S, ORPHAN_AGE_S, Sweeper

VERSION = "0.1.0"
#: Messages fetched from the durable consumer at once.
FETCH_BATCH = 64
#: Seconds one fetch waits for messages.
FETCH_WAIT_S = 1.0
#: Seconds to wait after a failed fetch before the next.
FETCH_RETRY_S = 0.5
#: Seconds the durable consumer waits for an acknowledgement before redelivering.
ACK_WAIT_S = 60.0
#: Overrides sweeper.ORPHAN_AGE_S (seconds; fault tests use 0).
ORPHAN_AGE_ENV = "LORAFLEET_ARTIFACT_ORPHAN_AGE_S"
#: Bytes nats-py reads from the socket at once in this process (its default
#: is 32 KiB). With 32 KiB, asyncio paused and resumed reading (an epoll
#: change each time) and the parser ran for every 32 KiB of a 512 KiB chunk:
#: 1 MiB cut the store's CPU by about 0.05 s per 200 MiB delivered.
READ_BUFFER_BYTES = 1 << 20


class ArtifactStore:
    """The artifact-store on one connection. `start()`, then `stop()`.

    idle_check_s: seconds without a chunk before an open delivery is checked
    again (sweeper.IDLE_CHECK_S, 60); the consumer loop ticks twice as often.
    """

    def __init__(
        self, nc: Client, settings: Settings, *, idle_check_s: float = IDLE_CHECK_S
    ) -> None:
        self.nc = nc
        self.js: JetStreamContext = nc.jetstream()
        self.settings = settings
        self.names: Names = settings.names
        self.logger = log.get()
        recorder = RecorderClient(nc, self.names, settings.request_timeout_s)
        clock = asyncio.get_running_loop().time
        self._pub = AsyncPublisher(nc)
        self.deliveries = Deliveries(Streams(self.js, self.names), self._pub, recorder, clock)
        self.sweeper = Sweeper(
            self.deliveries, recorder, clock,
            orphan_age_s=orphan_age_s(), idle_check_s=idle_check_s,
        )  # fmt: skip
        self.api = ArtifactApi(self.js, self.names)
        self._task: asyncio.Task[None] | None = None
        self._sub: JetStreamContext.PullSubscription | None = None
        self._stopping = False

    async def start(self) -> None:
        names = self.names
        await self._pub.start()
        config = ConsumerConfig(
            durable_name=names.artifact_store_consumer,
            ack_policy=AckPolicy.EXPLICIT,
            deliver_policy=DeliverPolicy.ALL,
            ack_wait=ACK_WAIT_S,
            max_ack_pending=4 * FETCH_BATCH * 16,
            filter_subject=names.artifacts_subjects,
        )
        self._sub = await self.js.pull_subscribe(
            names.artifacts_subjects,
            durable=names.artifact_store_consumer,
            stream=names.artifacts_stream,
            config=config,
        )
        await self.sweeper.sweep()
        await self.deliveries.recover_all()
        self._task = asyncio.create_task(self._loop(), name="artifact-store-loop")
        await start_service(
            self.nc,
            names.artifact_store_service,
            VERSION,
            "lorafleet artifacts: chunked delivery in, whole verified objects out",
            self.api.routes(),
            names.queue_group,
        )

    async def stop(self) -> None:
        self._stopping = True
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task
        if self._sub is not None:
            with contextlib.suppress(Exception):
                await self._sub.unsubscribe()
        await self._pub.close()

    # --- consuming -------------------------------------------------------------

    async def _loop(self) -> None:
        # The next batch is fetched while this one is processed: fetching only
        # between batches left the store idle for a round trip and a batch's transfer.
        batches: asyncio.Queue[list[Msg]] = asyncio.Queue(maxsize=1)
        fetcher = asyncio.create_task(self._fetch(batches), name="artifact-store-fetch")
        try:
            while not self._stopping:
                try:
                    batch = await asyncio.wait_for(batches.get(), self.sweeper.idle_check_s / 2)
                except TimeoutError:
                    batch = []
                await self.sweeper.tick()
                await self._handle(batch)
        finally:
            fetcher.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await fetcher

    async def _handle(self, batch: list[Msg]) -> None:
        for msg in batch:
            try:
                await self.deliveries.on_message(msg)
            except Exception as e:  # one bad delivery must not stop the others
                self.logger.exception(Event.ARTIFACT_REJECTED, error=repr(e))
                with contextlib.suppress(Exception):
                    await msg.nak(delay=RETRY_DELAY_S)

    async def _fetch(self, batches: asyncio.Queue[list[Msg]]) -> None:
        assert self._sub is not None
        while not self._stopping:
            try:
                msgs = await self._sub.fetch(FETCH_BATCH, timeout=FETCH_WAIT_S)
            except TimeoutError:
                continue
            except nats.errors.Error as e:
                self.logger.warning(Event.NATS_ERROR, error=repr(e))
                await asyncio.sleep(FETCH_RETRY_S)
                continue
            await batches.put(msgs)


def orphan_age_s() -> float:
    raw = os.environ.get(ORPHAN_AGE_ENV, "")
    if not raw:
        return ORPHAN_AGE_S
    try:
        value = float(raw)
    except ValueError:
        raise SettingsError(f"{ORPHAN_AGE_ENV}={raw!r} is not a number of seconds") from None
    if value < 0:
        raise SettingsError(f"{ORPHAN_AGE_ENV} must be >= 0 seconds")
    return value


async def run(settings: Settings, stop: asyncio.Event) -> None:
    logger = log.get()
    # nats-py takes its read size from this module global at connect (no option
    # for it); the store reads bulk, so it gets a bigger one.
    nats.aio.client.DEFAULT_BUFFER_SIZE = max(
        nats.aio.client.DEFAULT_BUFFER_SIZE, READ_BUFFER_BYTES
    )
    nc = await connect(settings, "lorafleet-artifact-store")
    store: ArtifactStore | None = None
    try:
        js = nc.jetstream()
        await ensure_layout(js, layout_for(settings))
        store = ArtifactStore(nc, settings)
        await store.start()
        logger.info(Event.SERVICE_STARTED, version=VERSION)
        await stop.wait()
    finally:
        if store is not None:
            await store.stop()
        await drain_quietly(nc)
        logger.info(Event.SERVICE_STOPPED)
