"""The artifact-store: assembles chunked deliveries into whole, verified objects.

How it stays exact when killed at any moment:

- Chunks stay in the artifacts stream (limits retention) until their
  artifact is committed; only then is the delivery's subject purged. The
  in-memory assembly is a cache of what the stream holds.
- Whenever a delivery is first seen (a new delivery, or the first chunk
  after a restart), its subject is read back from the stream from its start
  up to that chunk, so chunks acknowledged before a crash are not lost. At
  start, every subject still in the stream is read back the same way.
- Bytes that are in order are written straight onto the object's chunk
  subject (`$O.<bucket>.C.<job>_<kind>_<attempt>`, a fixed name so a dead
  store's half-written chunks are purged by the next one) while the
  delivery goes on. The object exists only once its info message is
  published, after count, size and sha256 are checked: whole or not at all.
- The durable pull consumer acknowledges ordinary chunks as they are
  taken, and the last chunk only once the artifact is committed (or failed).

Handlers stay thin; the decisions are in `assembly`.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import json
import os
import secrets
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import nats.aio.client
import nats.errors
import nats.js.errors
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

from lorafleet import log
from lorafleet.artifacts import (
    AsyncPublisher,
    decode_info,
    get_record,
    list_records,
    object_chunk_subject,
    object_meta_subject,
    object_stream,
    read_info,
)
from lorafleet.bus import (
    connect,
    drain_quietly,
    ensure_layout,
    layout_for,
)
from lorafleet.errors import NotFoundError
from lorafleet.log import Event
from lorafleet.names import Names
from lorafleet.recorder_client import RecorderClient
from lorafleet.service import Route, start_service
from lorafleet.settings import Settings, SettingsError
from lorafleet_schemas.messages import (
    ArtifactGetRequest,
    ArtifactList,
    ArtifactListRequest,
    ArtifactRecord,
    ArtifactStoredRequest,
    JobRecord,
)
from lorafleet_services.artifact_store.assembly import (
    Assembly,
    AssemblyError,
    Chunk,
    ChunkError,
    Key,
    is_committed_by,
    object_chunk_token,
    object_info,
    orphans,
    parse_chunk,
    refusal,
)

VERSION = "0.1.0"
#: Messages fetched from the durable consumer at once.
FETCH_BATCH = 64
#: Seconds one fetch waits for messages.
FETCH_WAIT_S = 1.0
#: Object chunk publishes awaiting their acknowledgement at once.
WRITE_WINDOW = 64
#: Seconds to wait for one object chunk's acknowledgement.
WRITE_ACK_TIMEOUT_S = 30.0
#: Seconds the durable consumer waits for an acknowledgement before redelivering.
ACK_WAIT_S = 60.0
#: Seconds to wait for chunks missing when the last one has arrived, before
#: reading the stream a final time and failing the delivery.
MISSING_GRACE_S = 1.0
#: Seconds without a new chunk after which an open delivery's job is checked
#: again (an agent that died mid-delivery leaves one; its job is failed elsewhere).
IDLE_CHECK_S = 60.0
#: Seconds after its newest chunk that an object chunk subject no object refers
#: to is taken for a dead store's leftovers and purged (a live replica writes
#: more often); the environment variable LORAFLEET_ARTIFACT_ORPHAN_AGE_S
#: overrides it (fault tests use 0).
ORPHAN_AGE_S = 600.0
ORPHAN_AGE_ENV = "LORAFLEET_ARTIFACT_ORPHAN_AGE_S"
#: Seconds between sweeps for such leftovers (one also runs at start).
SWEEP_EVERY_S = 300.0
#: Deliveries remembered as finished, so late duplicates are dropped.
FINISHED_MEMORY = 4096
#: Bytes nats-py reads from the socket at once in this process (its default
#: is 32 KiB). With 32 KiB, asyncio paused and resumed reading (an epoll
#: change each time) and the parser ran for every 32 KiB of a 512 KiB chunk:
#: 1 MiB cut the store's CPU by about 0.05 s per 200 MiB delivered.
READ_BUFFER_BYTES = 1 << 20


@dataclass(slots=True)
class _Delivery:
    """One delivery being assembled, and its object chunks being written."""

    key: Key
    subject: str
    #: This assembly's object nuid and the subject its object chunks go on.
    nuid: str
    chunks: str
    assembly: Assembly
    job: JobRecord
    writes: deque[asyncio.Future[int]] = field(default_factory=deque)
    chunks_written: int = 0
    max_chunk: int = 0
    #: The unacknowledged last chunk, acknowledged once committed or failed.
    held: list[Msg] = field(default_factory=list)
    #: Event-loop time of the newest chunk taken.
    touched: float = 0.0


class ArtifactStore:
    """The artifact-store on one connection. `start()`, then `close()`."""

    def __init__(self, nc: Client, settings: Settings) -> None:
        self.nc = nc
        self.js: JetStreamContext = nc.jetstream()
        self.settings = settings
        self.names: Names = settings.names
        self.recorder = RecorderClient(nc, self.names, settings.request_timeout_s)
        self.logger = log.get()
        self._deliveries: dict[Key, _Delivery] = {}
        self._finished: dict[Key, None] = {}
        self._task: asyncio.Task[None] | None = None
        self._sub: JetStreamContext.PullSubscription | None = None
        self._stopping = False
        self._pub = AsyncPublisher(nc)
        self._orphan_age_s = orphan_age_s()
        self._last_sweep = 0.0

    # --- life cycle ---------------------------------------------------------

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
        await self._sweep()
        await self._recover_all()
        self._task = asyncio.create_task(self._loop(), name="artifact-store-loop")
        await start_service(
            self.nc,
            names.artifact_store_service,
            VERSION,
            "lorafleet artifacts: chunked delivery in, whole verified objects out",
            [
                Route(names.artifacts_list, ArtifactListRequest, self.list_artifacts),
                Route(names.artifacts_get, ArtifactGetRequest, self.get_artifact),
            ],
            names.queue_group,
        )

    async def close(self) -> None:
        self._stopping = True
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task
        if self._sub is not None:
            with contextlib.suppress(Exception):
                await self._sub.unsubscribe()
        await self._pub.close()

    # --- the API ---------------------------------------------------------------

    async def list_artifacts(self, req: ArtifactListRequest) -> ArtifactList:
        return ArtifactList(artifacts=await list_records(self.js, self.names, req.job_id))

    async def get_artifact(self, req: ArtifactGetRequest) -> ArtifactRecord:
        rec = await get_record(self.js, self.names, req.job_id, req.kind.value)
        if rec is None:
            raise NotFoundError(
                f"job {req.job_id} has no stored {req.kind.value} artifact", "$.kind"
            )
        return rec

    # --- consuming -------------------------------------------------------------

    async def _loop(self) -> None:
        # The next batch is fetched while this one is processed: fetching only
        # between batches left the store idle for a round trip and a batch's transfer.
        batches: asyncio.Queue[list[Msg]] = asyncio.Queue(maxsize=1)
        fetcher = asyncio.create_task(self._fetch(batches), name="artifact-store-fetch")
        try:
            while not self._stopping:
                try:
                    batch = await asyncio.wait_for(batches.get(), IDLE_CHECK_S / 2)
                except TimeoutError:
                    batch = []
                await self._check_idle()
                if asyncio.get_running_loop().time() - self._last_sweep > SWEEP_EVERY_S:
                    await self._sweep()
                for msg in batch:
                    try:
                        await self._on_message(msg)
                    except Exception as e:  # one bad delivery must not stop the others
                        self.logger.exception(Event.ARTIFACT_REJECTED, error=repr(e))
                        with contextlib.suppress(Exception):
                            await msg.nak(delay=2.0)
        finally:
            fetcher.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await fetcher

    async def _check_idle(self) -> None:
        """Give up deliveries that stopped coming for a job that no longer takes them."""
        now = asyncio.get_running_loop().time()
        for d in [d for d in self._deliveries.values() if now - d.touched > IDLE_CHECK_S]:
            d.touched = now
            try:
                info = await read_info(self.js, self.names, d.key.job_id, d.key.kind.value)
                if info is not None and not info.deleted and is_committed_by(info.nuid, d.key):
                    # Another store (a replica) committed it.
                    await self._discard(d)
                    continue
                why = refusal(await self._job(d.key.job_id), d.key)
                if why is not None:
                    self.logger.warning(Event.ARTIFACT_REJECTED, job_id=d.key.job_id,
                                        node=d.key.node, kind=d.key.kind.value,
                                        error=f"gave up an unfinished delivery: {why}")  # fmt: skip
                    await self._discard(d)
            except Exception as e:
                self.logger.warning(Event.NATS_ERROR, job_id=d.key.job_id, error=repr(e))

    async def _sweep(self) -> None:
        """Purge object chunks that a store which died mid-write left behind."""
        loop = asyncio.get_running_loop()
        self._last_sweep = loop.time()
        stream = object_stream(self.names)
        bucket = self.names.artifacts_bucket
        try:
            chunks = await self.js.stream_info(stream, subjects_filter=f"$O.{bucket}.C.>")
            metas = await self.js.stream_info(stream, subjects_filter=f"$O.{bucket}.M.>")
            committed: set[str] = set()
            for subject in metas.state.subjects or {}:
                raw = await self.js.get_last_msg(stream, subject)
                info = decode_info(raw.data or b"")
                if info is not None and not info.deleted:
                    committed.add(object_chunk_subject(self.names, info.nuid))
            writing = {d.chunks for d in self._deliveries.values()}
            ages_s: dict[str, float] = {}
            wall_now = dt.datetime.now(dt.UTC)
            for subject in chunks.state.subjects or {}:
                if subject in committed or subject in writing:
                    continue
                raw = await self.js.get_last_msg(stream, subject)
                ages_s[subject] = (wall_now - raw.time).total_seconds() if raw.time else 0.0
            for subject in orphans(ages_s, committed, writing, min_age_s=self._orphan_age_s):
                self.logger.info(Event.ARTIFACT_REJECTED, error=f"purged leftover {subject}")
                await self.js.purge_stream(stream, subject=subject)
        except nats.js.errors.NotFoundError:
            return
        except nats.errors.Error as e:
            self.logger.warning(Event.NATS_ERROR, error=f"sweeping leftovers: {e!r}")

    async def _fetch(self, batches: asyncio.Queue[list[Msg]]) -> None:
        assert self._sub is not None
        while not self._stopping:
            try:
                msgs = await self._sub.fetch(FETCH_BATCH, timeout=FETCH_WAIT_S)
            except TimeoutError:
                continue
            except nats.errors.Error as e:
                self.logger.warning(Event.NATS_ERROR, error=repr(e))
                await asyncio.sleep(0.5)
                continue
            await batches.put(msgs)

    async def _on_message(self, msg: Msg) -> None:
        stream_seq = msg.metadata.sequence.stream
        try:
            chunk = parse_chunk(self.names, msg.subject, msg.headers)
        except ChunkError as e:
            self.logger.warning(Event.ARTIFACT_REJECTED, error=str(e))
            await self._purge_delivery(msg.subject, stream_seq)
            await msg.ack()
            return
        key = chunk.key
        if key in self._finished:
            # A late duplicate, or more of a refused delivery: gone with the rest.
            if not any(d.subject == msg.subject for d in self._deliveries.values()):
                await self._purge_delivery(msg.subject, stream_seq)
            await msg.ack()
            return
        try:
            await self._on_chunk(msg, chunk, stream_seq)
        except AssemblyError as e:
            # Chunks that cannot make an artifact (beyond the count, two
            # different last chunks): retrying would not help.
            d = self._deliveries.get(key)
            if d is None:
                raise
            d.held.append(msg)
            await self._fail(d, str(e))
        except Exception:
            await self._drop(key)
            raise

    async def _on_chunk(self, msg: Msg, chunk: Chunk, stream_seq: int) -> None:
        key = chunk.key
        d = self._deliveries.get(key)
        if d is None:
            d = await self._open(chunk, stream_seq)
            if d is None:
                await msg.ack()
                return
        else:
            await self._take(d, chunk, msg.data, stream_seq)
        if chunk.header.last:
            d.held.append(msg)
        else:
            await msg.ack()
        if d.assembly.has_last:
            await self._finish(d)

    async def _recover_all(self) -> None:
        """Read back every delivery still in the stream (a restart loses the cache)."""
        try:
            info = await self.js.stream_info(
                self.names.artifacts_stream, subjects_filter=self.names.artifacts_subjects
            )
        except nats.js.errors.NotFoundError:
            return
        for subject in sorted((info.state.subjects or {}).keys()):
            try:
                last = await self.js.get_last_msg(self.names.artifacts_stream, subject)
            except nats.js.errors.NotFoundError:
                continue
            try:
                chunk = parse_chunk(self.names, subject, last.headers)
            except ChunkError as e:
                self.logger.warning(Event.ARTIFACT_REJECTED, error=str(e))
                await self._purge_delivery(subject, last.seq or 0)
                continue
            if chunk.key in self._deliveries or chunk.key in self._finished:
                continue
            try:
                d = await self._open(chunk, last.seq or 0)
                if d is not None and d.assembly.has_last:
                    await self._finish(d)
            except AssemblyError as e:
                if (bad := self._deliveries.get(chunk.key)) is not None:
                    await self._fail(bad, str(e))
            except Exception as e:
                self.logger.exception(
                    Event.ARTIFACT_REJECTED, job_id=chunk.key.job_id, error=repr(e)
                )
                await self._drop(chunk.key)

    # --- one delivery -----------------------------------------------------------

    async def _job(self, job_id: str) -> JobRecord | None:
        return await self.recorder.get_job(job_id)

    async def _open(self, chunk: Chunk, upto_seq: int) -> _Delivery | None:
        """Start assembling a delivery, from the stream's first chunk of it up to `upto_seq`.

        Returns None when the delivery is refused or already stored.
        """
        key = chunk.key
        job = await self._job(key.job_id)
        # Already committed (a store that died after the commit, before the purge)?
        info = await read_info(self.js, self.names, key.job_id, key.kind.value)
        if info is not None and not info.deleted and is_committed_by(info.nuid, key):
            self.logger.info(Event.ARTIFACT_STORED, job_id=key.job_id, kind=key.kind.value,
                             message="already stored; finishing its clean-up")  # fmt: skip
            if job is not None and key.kind not in job.artifacts_stored:
                await self._tell_recorder(key, info.size, info.metadata.get("sha256", ""))
            await self._purge_delivery(chunk.subject, upto_seq)
            self._remember(key)
            return None
        why = refusal(job, key)
        if why is not None:
            self.logger.warning(
                Event.ARTIFACT_REJECTED, job_id=key.job_id, node=key.node, kind=key.kind.value,
                error=f"refused a delivery from node {key.node}: {why}",
            )  # fmt: skip
            await self._purge_delivery(chunk.subject, upto_seq)
            self._remember(key)
            return None
        assert job is not None
        nuid = object_chunk_token(key, secrets.token_hex(8))
        d = _Delivery(
            key=key, subject=chunk.subject, nuid=nuid,
            chunks=object_chunk_subject(self.names, nuid),
            assembly=Assembly(key), job=job,
        )  # fmt: skip
        self._deliveries[key] = d
        await self._read_back(d, upto_seq)
        return d

    async def _read_back(self, d: _Delivery, upto_seq: int) -> None:
        """Feed every chunk of `d` in the stream with a sequence up to `upto_seq`."""
        stream = self.names.artifacts_stream
        sub = await self.js.pull_subscribe(
            d.subject,
            stream=stream,
            config=ConsumerConfig(
                ack_policy=AckPolicy.NONE,
                deliver_policy=DeliverPolicy.ALL,
                inactive_threshold=30.0,
                mem_storage=True,
            ),
        )
        seq = 0
        try:
            while True:
                # Ask for no more messages than can lie at or below upto_seq: the
                # stream goes on filling meanwhile, and a delivery opened at its
                # first chunk needs that chunk alone (a full batch here pulled
                # 12-32 MiB more through the server and the store for nothing).
                batch = max(1, min(FETCH_BATCH, upto_seq - seq)) if seq else 1
                try:
                    msgs = await sub.fetch(batch, timeout=2.0)
                except TimeoutError:
                    return
                for m in msgs:
                    seq = m.metadata.sequence.stream
                    if seq > upto_seq:
                        return
                    try:
                        chunk = parse_chunk(self.names, m.subject, m.headers)
                    except ChunkError:
                        continue
                    if chunk.key == d.key:
                        await self._take(d, chunk, m.data, seq)
                    if seq >= upto_seq or m.metadata.num_pending == 0:
                        return
        finally:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()
            with contextlib.suppress(Exception):
                info = await sub.consumer_info()
                await self.js.delete_consumer(stream, info.name)

    async def _take(self, d: _Delivery, chunk: Chunk, body: bytes, stream_seq: int) -> None:
        d.touched = asyncio.get_running_loop().time()
        for ready in d.assembly.add(chunk.header, body, stream_seq):
            if not ready:
                continue
            d.max_chunk = max(d.max_chunk, len(ready))
            d.writes.append(await self._pub.publish(d.chunks, ready))
            d.chunks_written += 1
            while len(d.writes) >= WRITE_WINDOW:
                await asyncio.wait_for(d.writes.popleft(), WRITE_ACK_TIMEOUT_S)

    async def _finish(self, d: _Delivery) -> None:
        """The last chunk is here: verify, commit, tell the recorder, clean up."""
        key = d.key
        if d.assembly.missing():
            # A well-behaved agent sends the last chunk after all the others
            # are stored; read the stream again before calling it short.
            await self._read_back(d, d.assembly.stream_seq)
            if d.assembly.missing():
                await asyncio.sleep(MISSING_GRACE_S)
                latest = await self._last_seq(d.subject)
                await self._read_back(d, max(latest, d.assembly.stream_seq))
        try:
            whole = d.assembly.verify()
        except AssemblyError as e:
            await self._fail(d, str(e))
            return
        while d.writes:
            await asyncio.wait_for(d.writes.popleft(), WRITE_ACK_TIMEOUT_S)
        job = await self._job(key.job_id)
        why = refusal(job, key)
        if why is not None:
            self.logger.warning(Event.ARTIFACT_REJECTED, job_id=key.job_id, node=key.node,
                                kind=key.kind.value, error=f"not stored: {why}")  # fmt: skip
            await self._discard(d)
            return
        assert job is not None
        stored = await self._stored_chunks(d)
        if stored != d.chunks_written:
            raise RuntimeError(
                f"{key.label}: {stored} object chunks are stored, {d.chunks_written} were written"
            )
        info = object_info(
            self.names, key, whole,
            chunks=d.chunks_written, chunk_bytes=max(d.max_chunk, 1),
            base_model=job.model, now=dt.datetime.now(dt.UTC), nuid=d.nuid,
        )  # fmt: skip
        await self.js.publish(
            object_meta_subject(self.names, key.job_id, key.kind.value),
            json.dumps(info).encode(),
            headers={"Nats-Rollup": "sub"},
        )
        check = await read_info(self.js, self.names, key.job_id, key.kind.value)
        if check is None or (check.size, check.digest, check.nuid) != (
            whole.size,
            info["digest"],
            info["nuid"],
        ):
            raise RuntimeError(f"{key.label}: the stored object's info does not read back")
        await self._tell_recorder(key, whole.size, whole.sha256)
        await self._purge_delivery(d.subject, d.assembly.stream_seq)
        self.logger.info(
            Event.ARTIFACT_STORED, job_id=key.job_id, node=key.node, kind=key.kind.value,
            size=whole.size, sha256=whole.sha256, chunks=whole.count,
        )  # fmt: skip
        await self._close(d)

    async def _stored_chunks(self, d: _Delivery) -> int:
        info = await self.js.stream_info(object_stream(self.names), subjects_filter=d.chunks)
        return int((info.state.subjects or {}).get(d.chunks, 0))

    async def _last_seq(self, subject: str) -> int:
        try:
            raw = await self.js.get_last_msg(self.names.artifacts_stream, subject)
        except nats.js.errors.NotFoundError:
            return 0
        return raw.seq or 0

    async def _tell_recorder(self, key: Key, size: int, sha256: str) -> None:
        await self.recorder.artifact_stored(
            ArtifactStoredRequest(id=key.job_id, kind=key.kind, size=size, sha256=sha256)
        )

    async def _fail(self, d: _Delivery, message: str) -> None:
        """A short or corrupt delivery: nothing stored, the job failed, saying why."""
        key = d.key
        self.logger.warning(Event.ARTIFACT_REJECTED, job_id=key.job_id, node=key.node,
                            kind=key.kind.value, error=message)  # fmt: skip
        # The job first: a store that dies after this finds the job failed and
        # purges the chunks; the other way round, the job would wait for nothing.
        await self._fail_job(key.job_id, message)
        await self._discard(d)

    async def _fail_job(self, job_id: str, message: str) -> None:
        await self.recorder.fail_job(job_id, message)

    async def _discard(self, d: _Delivery) -> None:
        # Writes still in flight would land after the purge: let them land first.
        while d.writes:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(d.writes.popleft(), WRITE_ACK_TIMEOUT_S)
        await self.js.purge_stream(object_stream(self.names), subject=d.chunks)
        await self._purge_delivery(d.subject, d.assembly.stream_seq)
        await self._close(d)

    async def _close(self, d: _Delivery) -> None:
        self._deliveries.pop(d.key, None)
        self._remember(d.key)
        for m in d.held:
            with contextlib.suppress(Exception):
                await m.ack()
        d.held.clear()

    async def _drop(self, key: Key) -> None:
        """Forget a delivery after an error; the stream still has it for a retry."""
        d = self._deliveries.pop(key, None)
        if d is None:
            return
        # Let in-flight object writes land, then remove them (the next try
        # writes under a new nuid); what a failed purge leaves, the sweep takes.
        while d.writes:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(d.writes.popleft(), WRITE_ACK_TIMEOUT_S)
        with contextlib.suppress(Exception):
            await self.js.purge_stream(object_stream(self.names), subject=d.chunks)
        for m in d.held:
            with contextlib.suppress(Exception):
                await m.nak(delay=2.0)

    def _remember(self, key: Key) -> None:
        self._finished[key] = None
        while len(self._finished) > FINISHED_MEMORY:
            self._finished.pop(next(iter(self._finished)))

    async def _purge_delivery(self, subject: str, upto_seq: int) -> None:
        """Remove a delivery's chunks, up to and including stream sequence `upto_seq`."""
        kwargs: dict[str, Any] = {"subject": subject}
        if upto_seq:
            kwargs["seq"] = upto_seq + 1
        await self.js.purge_stream(self.names.artifacts_stream, **kwargs)


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
            await store.close()
        await drain_quietly(nc)
        logger.info(Event.SERVICE_STOPPED)
