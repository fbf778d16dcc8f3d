"""The artifact-store: assembles chunked deliveries into whole, verified objects.

This module wires its pieces (assembly, delivery, streams, sweeper, api:
the module table and why it stays exact when killed at any moment are in
DESIGN.md) to the durable pull consumer (`lorafleet.nats._consumer`:
the sweeper's tick runs between batches, and every `idle_check_s / 2`
seconds without one) and runs the process (`runtime.serve(PROGRAM)`).
"""

from __future__ import annotations

import asyncio
import contextlib

from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js import JetStreamContext

import lorafleet
from lorafleet import _runtime as runtime
from lorafleet import log
from lorafleet._recorder_client import RecorderClient
from lorafleet._tasks import stop_tasks
from lorafleet.access.permissions import owned_layout_parts
from lorafleet.artifacts import AsyncPublisher
from lorafleet.log import Event
from lorafleet.names import Names
from lorafleet.nats._bus import ensure_layout, layout_for, when_cluster_answers
from lorafleet.nats._consumer import PullConsumer, PullConsumerConfig
from lorafleet.nats._micro import Route, start_service
from lorafleet.nats._natspy import use_read_buffer
from lorafleet.retention._sweep import RetentionSweep, wall_now
from lorafleet.retention.rules import Policy
from lorafleet.settings import Settings
from lorafleet_schemas.messages import GcReport, GcRequest
from lorafleet_services.artifact_store.api import ArtifactApi
from lorafleet_services.artifact_store.delivery import RETRY_DELAY_S, Deliveries
from lorafleet_services.artifact_store.retention import ArtifactJudge
from lorafleet_services.artifact_store.streams import Streams
from lorafleet_services.artifact_store.sweeper import IDLE_CHECK_S, Sweeper

#: Messages fetched from the durable consumer at once.
CHUNK_FETCH_BATCH = 64
#: Seconds one fetch waits for messages when none are there (with chunks in
#: the stream a fetch returns at once). `stop()` lets the fetch in flight end
#: (its messages would otherwise wait ACK_WAIT_S): 1 s made every stop 1 s.
FETCH_WAIT_S = 0.25
#: Seconds the durable consumer waits for an acknowledgement before redelivering.
ACK_WAIT_S = 60.0
#: Chunks delivered and not yet acknowledged, at most (a held last chunk per
#: delivery, and the batches in hand).
CHUNK_MAX_ACK_PENDING = 4 * CHUNK_FETCH_BATCH * 16
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
        recorder = RecorderClient(
            nc,
            self.names,
            settings.request_timeout_s,
            no_responders_retry_s=settings.no_responders_retry_s,
        )
        clock = asyncio.get_running_loop().time
        self._pub = AsyncPublisher(nc)
        self.deliveries = Deliveries(Streams(self.js, self.names), self._pub, recorder, clock)
        self.sweeper = Sweeper(
            self.deliveries, recorder, clock,
            orphan_age_s=settings.artifact_orphan_age_s, idle_check_s=idle_check_s,
        )  # fmt: skip
        self.api = ArtifactApi(self.js, self.names)
        policy = Policy.of(settings)
        judge = ArtifactJudge(recorder, policy, wall_now)
        self.retention = RetentionSweep(
            self.js, self.names.artifacts_bucket, judge, policy, before_remove=judge.before_remove
        )
        self._retention_task: asyncio.Task[None] | None = None
        self._consumer: PullConsumer | None = None

    async def start(self) -> None:
        names = self.names
        await self._pub.start()
        self._consumer = PullConsumer(
            self.js,
            PullConsumerConfig(
                stream=names.artifacts_stream,
                durable=names.artifact_store_consumer,
                filter_subject=names.artifacts_subjects,
                ack_wait_s=ACK_WAIT_S,
                max_ack_pending=CHUNK_MAX_ACK_PENDING,
                batch=CHUNK_FETCH_BATCH,
                fetch_wait_s=FETCH_WAIT_S,
            ),
            self._handle,
            ensure_stream=self._ensure_layout,
            on_tick=self.sweeper.tick,
            tick_s=self.sweeper.idle_check_s / 2,
        )
        # A dead store's leftovers first, then every delivery still in the stream
        # (chunks it acknowledged come from the consumer no more), then new chunks.
        # The sweep logs its errors and is tried again by the ticks; the other
        # two wait for a cluster between leaders (nemesis, issue 33).
        await self.sweeper.sweep()
        await when_cluster_answers(
            "the artifact-store's recovery of deliveries", self.deliveries.recover_all
        )
        await when_cluster_answers("the artifact-store's consumer", self._consumer.start)
        await start_service(
            self.nc,
            names.artifact_store_service,
            lorafleet.__version__,
            "lorafleet artifacts: chunked delivery in, whole verified objects out",
            [*self.api.routes(), Route(names.artifacts_gc, GcRequest, self.gc)],
            names.queue_group,
        )
        if self.settings.retention_sweep_every_s > 0:
            self._retention_task = asyncio.create_task(
                self.retention.every(self.settings.retention_sweep_every_s)
            )

    async def gc(self, req: GcRequest) -> GcReport:
        """`api.artifacts.gc`: one retention run of the artifacts bucket."""
        return await self.retention.run(req.dry_run)

    async def stop(self) -> None:
        await stop_tasks(self._retention_task)
        if self._consumer is not None:
            await self._consumer.stop()
        await self._pub.stop()

    async def _ensure_layout(self) -> None:
        parts = owned_layout_parts(self.settings.nats_nkey_seed, PROGRAM.name)
        await ensure_layout(self.js, layout_for(self.settings), parts)

    async def _handle(self, batch: list[Msg]) -> None:
        """One batch from the durable consumer; each message is acked (or held) by
        the delivery it belongs to."""
        for msg in batch:
            try:
                await self.deliveries.on_message(msg)
            except Exception as e:  # one bad delivery must not stop the others
                # The subject names the delivery (job, node, kind): nemesis seed
                # 17's job left uploading after such a failure, and its log did not say whose.
                self.logger.exception(Event.ARTIFACT_REJECTED, error=repr(e), subject=msg.subject)
                with contextlib.suppress(Exception):
                    await msg.nak(delay=RETRY_DELAY_S)


async def use_bulk_reads(settings: Settings) -> None:
    """Before connecting: this process's connections read in big steps (READ_BUFFER_BYTES)."""
    use_read_buffer(READ_BUFFER_BYTES)


async def make(nc: Client, settings: Settings) -> ArtifactStore:
    return ArtifactStore(nc, settings)


PROGRAM = runtime.Program(
    "artifact-store", make, before_connect=use_bulk_reads, client_name="lorafleet-artifact-store"
)
