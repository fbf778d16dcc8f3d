"""The delivery state machine: one artifact's chunks, from first sight to gone.

A delivery is *opened* the first time one of its chunks is seen (its
subject read back from the stream up to that chunk), *takes* chunks
(streaming the bytes in order into its object's chunks), and ends
*finished* (committed), *failed* (short or corrupt: the job failed),
*discarded* (refused, given up) or *dropped* (an error: the stream keeps
it for the retry). DESIGN.md gives each step and why the order is exact.

The decisions are plain functions (`idle` here, the rest in `assembly`);
`Deliveries` does the I/O, through `streams`.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import secrets
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Protocol

from nats.aio.msg import Msg

from lorafleet import log, metrics
from lorafleet._recorder_client import Ended
from lorafleet.artifacts import AsyncPublisher
from lorafleet.errors import BadRequestError
from lorafleet.log import Event
from lorafleet.names import Names, artifact_object_name, object_chunk_subject
from lorafleet.objects import WRITE_ACK_TIMEOUT_S, ObjectWriter
from lorafleet_schemas.messages import ArtifactStoredRequest, JobRecord
from lorafleet_services.artifact_store.assembly import (
    Assembly,
    AssemblyError,
    Chunk,
    ChunkError,
    EndedDeliveries,
    Key,
    VerifiedArtifact,
    delivery_refusal_reason,
    is_stored,
    object_chunk_token,
    object_info,
    parse_chunk,
    report_owed,
    superseded,
)
from lorafleet_services.artifact_store.streams import CommitError, Streams

#: Seconds to wait for chunks missing when the last one has arrived, before
#: reading the stream a final time and failing the delivery.
MISSING_GRACE_S = 1.0
#: Seconds before a chunk put back (nak) after an error is delivered again.
RETRY_DELAY_S = 2.0
#: Seconds a delivery may go on failing to be stored, each try put back,
#: before its job is failed saying why: a full disk halts the object store's
#: stream until its nats-server restarts, and nothing else would end the
#: tries (docs/operations.md; tests/nemesis/test_found.py pins it).
STORE_PATIENCE_S = 60.0


class RecorderRequests(Protocol):
    """What the store asks of the recorder (`RecorderClient`; tests pass a fake)."""

    async def get_job(self, job_id: str) -> JobRecord | None: ...
    async def artifact_stored(self, req: ArtifactStoredRequest) -> JobRecord: ...
    async def fail_job(self, job: JobRecord | str, message: str) -> Ended: ...


def idle(deliveries: Iterable[Delivery], now: float, idle_s: float) -> list[Delivery]:
    """Open deliveries with no chunk taken for more than `idle_s` seconds."""
    return [d for d in deliveries if now - d.touched > idle_s]


@dataclass(slots=True)
class Delivery:
    """One delivery being assembled, and its object chunks being written."""

    key: Key
    subject: str
    #: This assembly's object nuid (unique to this writer); its chunks go to `writer`.
    nuid: str
    writer: ObjectWriter
    assembly: Assembly
    #: The unacknowledged last chunk, acknowledged once committed or failed.
    held: list[Msg] = field(default_factory=list)
    #: Clock time (seconds) of the newest chunk taken.
    touched: float = 0.0
    #: Its info was sent (stored, perhaps, even when the publish or the read
    #: back failed): its object chunks may belong to a stored object, so no
    #: drop purges them; the sweep does if no info refers to them.
    committed: bool = False
    #: Monotonic seconds when it was opened (its delivery duration starts).
    opened_s: float = field(default_factory=time.monotonic)


# --- the machine ------------------------------------------------------------------


class Deliveries:
    """Every delivery this store has open, and what it does with each chunk.

    `clock`: seconds, monotonic (the event loop's time in the service).
    """

    def __init__(
        self,
        streams: Streams,
        publisher: AsyncPublisher,
        recorder: RecorderRequests,
        clock: Callable[[], float],
        store_patience_s: float = STORE_PATIENCE_S,
        write_ack_timeout_s: float = WRITE_ACK_TIMEOUT_S,
    ) -> None:
        self.streams = streams
        self.store_patience_s = store_patience_s
        self.write_ack_timeout_s = write_ack_timeout_s
        #: Key -> clock time of the first of its failed tries still unbroken.
        self.failing: dict[Key, float] = {}
        self.names: Names = streams.names
        self.publisher = publisher
        self.recorder = recorder
        self.clock = clock
        self.logger = log.get()
        self.open: dict[Key, Delivery] = {}
        self.ended = EndedDeliveries()

    def writing(self) -> set[str]:
        """The object chunk subjects this store is writing."""
        return {d.writer.subject for d in self.open.values()}

    # --- entry points ------------------------------------------------------------

    async def on_message(self, msg: Msg) -> None:
        """One message from the durable consumer; acknowledged (or held) here."""
        stream_seq = msg.metadata.sequence.stream
        try:
            chunk = parse_chunk(self.names, msg.subject, msg.headers)
        except ChunkError as e:
            self.logger.warning(Event.ARTIFACT_REJECTED, error=str(e))
            await self.streams.purge_delivery(msg.subject, stream_seq)
            await msg.ack()
            return
        key = chunk.key
        if key in self.ended:
            # A late duplicate, or more of a refused delivery: gone with the rest.
            if not any(d.subject == msg.subject for d in self.open.values()):
                await self.streams.purge_delivery(msg.subject, stream_seq)
            await msg.ack()
            return
        try:
            await self._on_chunk(msg, chunk, stream_seq)
        except AssemblyError as e:
            # Chunks that cannot make an artifact (beyond the count, two
            # different last chunks): retrying would not help.
            d = self.open.get(key)
            if d is None:
                raise
            d.held.append(msg)
            await self.fail(d, str(e))
        except Exception as e:
            if await self._gave_up(chunk, stream_seq, e, msg):
                return
            await self.drop(key)
            raise

    async def recover_all(self) -> None:
        """Read back every delivery still in the stream (a restart loses the cache)."""
        for subject in await self.streams.delivery_subjects():
            last = await self.streams.last_message(subject)
            if last is None:
                continue
            try:
                chunk = parse_chunk(self.names, subject, last.headers)
            except ChunkError as e:
                self.logger.warning(Event.ARTIFACT_REJECTED, error=str(e))
                await self.streams.purge_delivery(subject, last.seq or 0)
                continue
            if chunk.key in self.open or chunk.key in self.ended:
                continue
            await self._recover(chunk, last.seq or 0)

    async def _recover(self, chunk: Chunk, last_seq: int) -> None:
        try:
            d = await self._open(chunk, last_seq)
            if d is not None and d.assembly.has_last:
                await self._finish(d)
        except AssemblyError as e:
            if (bad := self.open.get(chunk.key)) is not None:
                await self.fail(bad, str(e))
        except Exception as e:
            if await self._gave_up(chunk, last_seq, e):
                return
            self.logger.exception(Event.ARTIFACT_REJECTED, job_id=chunk.key.job_id, error=repr(e))
            await self.drop(chunk.key)

    async def _gave_up(
        self, chunk: Chunk, upto_seq: int, error: Exception, msg: Msg | None = None
    ) -> bool:
        """After a failed try: True when the delivery has failed for
        `store_patience_s` and its job is now failed, saying why. A delivery
        that cannot even be opened (its object's info unreadable while the
        object store's stream is halted: nemesis seed 17's job stayed
        `uploading`) is given up on the same bound."""
        key = chunk.key
        now = self.clock()
        failing_s = now - self.failing.setdefault(key, now)
        if failing_s < self.store_patience_s:
            return False
        message = store_failed_message(key, failing_s, error)
        d = self.open.get(key)
        if d is not None:
            if msg is not None:
                d.held.append(msg)
            await self.fail(d, message)
            return True
        await self._reject(key, message)
        self.failing.pop(key, None)
        self.ended.add(key)  # its later chunks are purged as they come
        with contextlib.suppress(Exception):  # what stays, the next chunk's purge takes
            await self.streams.purge_delivery(chunk.subject, upto_seq)
        if msg is not None:
            with contextlib.suppress(Exception):
                await msg.ack()
        return True

    # --- one delivery -------------------------------------------------------------

    async def _on_chunk(self, msg: Msg, chunk: Chunk, stream_seq: int) -> None:
        d = self.open.get(chunk.key)
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

    async def _open(self, chunk: Chunk, upto_seq: int) -> Delivery | None:
        """Start assembling a delivery, from the stream's first chunk of it up to `upto_seq`.

        Returns None when the delivery is refused or already stored.
        """
        key = chunk.key
        job = await self.recorder.get_job(key.job_id)
        # Already committed (a store that died after the commit, before the purge)?
        info = await self.streams.read_info(key)
        if is_stored(info, key):
            self.logger.info(Event.ARTIFACT_STORED, job_id=key.job_id, kind=key.kind.value,
                             message="already stored; finishing its clean-up")  # fmt: skip
            if report_owed(job, key):
                await self._tell_recorder(key, info.size, info.metadata.get("sha256", ""))
            await self.streams.purge_delivery(chunk.subject, upto_seq)
            self.ended.add(key)
            return None
        why = delivery_refusal_reason(job, key)
        if why is not None:
            metrics.ARTIFACTS_REJECTED.inc()
            self.logger.warning(
                Event.ARTIFACT_REJECTED, job_id=key.job_id, node=key.node, kind=key.kind.value,
                error=f"refused a delivery from node {key.node}: {why}",
            )  # fmt: skip
            await self.streams.purge_delivery(chunk.subject, upto_seq)
            self.ended.add(key)
            return None
        nuid = object_chunk_token(key, secrets.token_hex(8))
        writer = ObjectWriter(
            self.publisher,
            object_chunk_subject(self.names.artifacts_bucket, nuid),
            self.write_ack_timeout_s,
        )
        d = Delivery(
            key=key, subject=chunk.subject, nuid=nuid, writer=writer, assembly=Assembly(key)
        )
        self.open[key] = d
        await self._read_back(d, upto_seq)
        return d

    async def _read_back(self, d: Delivery, upto_seq: int) -> None:
        async def take(chunk: Chunk, body: bytes, seq: int) -> None:
            await self._take(d, chunk, body, seq)

        await self.streams.read_back(d.subject, d.key, upto_seq, take)

    async def _take(self, d: Delivery, chunk: Chunk, body: bytes, stream_seq: int) -> None:
        d.touched = self.clock()
        for ready in d.assembly.add(chunk.header, body, stream_seq):
            if ready:
                await d.writer.write(ready)

    async def _finish(self, d: Delivery) -> None:
        """The last chunk is here: verify, commit, tell the recorder, clean up."""
        await self._fill_gaps(d)
        try:
            whole = d.assembly.verify()
        except AssemblyError as e:
            await self.fail(d, str(e))
            return
        await d.writer.flush()
        key = d.key
        job = await self.recorder.get_job(key.job_id)
        why = delivery_refusal_reason(job, key)
        previous = await self.streams.read_info(key) if key.is_checkpoint else None
        if why is None and key.is_checkpoint:
            why = superseded(previous, key)
        if why is not None or job is None:  # (the reason covers a missing job)
            self.logger.warning(Event.ARTIFACT_REJECTED, job_id=key.job_id, node=key.node,
                                kind=key.kind.value, error=f"not stored: {why}")  # fmt: skip
            await self.discard(d)
            return
        await self._commit(d, whole, job)
        await self._tell_recorder(key, whole.size, whole.sha256)
        await self.streams.purge_delivery(d.subject, d.assembly.stream_seq)
        if previous is not None and previous.nuid and previous.nuid != d.nuid:
            # The checkpoint it replaces: only the newest is kept. What a store
            # that dies before this leaves, no info refers to: the sweep takes it.
            await self.streams.purge_object_chunks(
                object_chunk_subject(self.names.artifacts_bucket, previous.nuid)
            )
        metrics.artifact_stored(key.kind.value, whole.size, time.monotonic() - d.opened_s)
        self.logger.info(
            Event.ARTIFACT_STORED, job_id=key.job_id, node=key.node, kind=key.kind.value,
            size=whole.size, sha256=whole.sha256, chunks=whole.count,
            **({"step": key.step} if key.is_checkpoint else {}),
        )  # fmt: skip
        await self._close(d)

    async def _fill_gaps(self, d: Delivery) -> None:
        """Give the stream its chance to fill the gaps before the delivery is called short."""
        if d.assembly.missing():
            # A well-behaved agent sends the last chunk after all the others
            # are stored; read the stream again before calling it short.
            await self._read_back(d, d.assembly.stream_seq)
            if d.assembly.missing():
                await asyncio.sleep(MISSING_GRACE_S)
                latest = await self.streams.last_seq(d.subject)
                await self._read_back(d, max(latest, d.assembly.stream_seq))

    async def _commit(self, d: Delivery, whole: VerifiedArtifact, job: JobRecord) -> None:
        """Make the object exist: its info, once every chunk written is stored."""
        stored = await self.streams.stored_chunks(d.writer.subject)
        if stored != d.writer.chunks_written:
            raise CommitError(
                f"{d.key.label}: {stored} object chunks are stored, "
                f"{d.writer.chunks_written} were written"
            )
        info = object_info(
            self.names, d.key, whole,
            chunks=d.writer.chunks_written, chunk_bytes=max(d.writer.max_chunk, 1),
            base_model=job.model, now=dt.datetime.now(dt.UTC), nuid=d.nuid,
        )  # fmt: skip
        # Before the publish: a member's fault can store the info and lose its
        # ack, and a drop that then purged the chunks would leave a done job's
        # artifact listed without its bytes (tests/nemesis/test_found.py).
        d.committed = True
        await self.streams.commit(d.key, info)

    async def _tell_recorder(self, key: Key, size: int, sha256: str) -> None:
        if not key.is_checkpoint:
            await self.recorder.artifact_stored(
                ArtifactStoredRequest(id=key.job_id, kind=key.kind, size=size, sha256=sha256)
            )
            return
        req = ArtifactStoredRequest(
            id=key.job_id, kind=key.kind, size=size, sha256=sha256, step=key.step,
            attempt=key.attempt, object=artifact_object_name(key.job_id, key.kind.value),
        )  # fmt: skip
        try:
            await self.recorder.artifact_stored(req)
        except BadRequestError as e:
            # A recorder that does not keep checkpoints (an older version) says
            # so each time: asking again would loop. The checkpoint is stored;
            # the job just cannot resume from it.
            self.logger.warning(
                Event.ARTIFACT_REJECTED, job_id=key.job_id, kind=key.kind.value, step=key.step,
                error=f"stored, but the recorder did not take it: {e}",
            )  # fmt: skip

    # --- endings --------------------------------------------------------------------

    async def fail(self, d: Delivery, message: str) -> None:
        """A short or corrupt delivery: nothing stored, the job failed, saying why
        (a checkpoint's job goes on: the one stored before stays its newest)."""
        await self._reject(d.key, message)
        await self.discard(d)

    async def _reject(self, key: Key, message: str) -> None:
        """Count, log, and fail the job saying `message`: the job first (a
        store that dies after this finds the job failed and purges the chunks;
        the other way round, the job would wait for nothing). Not for a
        checkpoint: no job waits for one, and the stored one stays."""
        metrics.ARTIFACTS_REJECTED.inc()
        self.logger.warning(Event.ARTIFACT_REJECTED, job_id=key.job_id, node=key.node,
                            kind=key.kind.value, error=message)  # fmt: skip
        if not key.is_checkpoint:
            await self.recorder.fail_job(key.job_id, message)

    async def discard(self, d: Delivery) -> None:
        """Remove what the delivery wrote and what the stream holds of it; it is over."""
        # Writes still in flight would land after the purge: let them land first.
        await d.writer.settle()
        # A halted object store (a full disk) takes no purge either: what it
        # keeps, no info refers to, and the sweep takes it once it works.
        try:
            await self.streams.purge_object_chunks(d.writer.subject)
        except Exception as e:
            self.logger.warning(Event.ARTIFACT_REJECTED, job_id=d.key.job_id,
                                error=f"its object chunks left to the sweep: {e!r}")  # fmt: skip
        await self.streams.purge_delivery(d.subject, d.assembly.stream_seq)
        await self._close(d)

    async def _close(self, d: Delivery) -> None:
        self.open.pop(d.key, None)
        self.failing.pop(d.key, None)
        self.ended.add(d.key)
        for m in d.held:
            with contextlib.suppress(Exception):
                await m.ack()
        d.held.clear()

    async def drop(self, key: Key) -> None:
        """Forget a delivery after an error; the stream still has it for a retry."""
        d = self.open.pop(key, None)
        if d is None:
            return
        # Let in-flight object writes land, then remove them (the next try
        # writes under a new nuid); what a failed purge leaves, the sweep takes.
        # A committed object's chunks stay: the retry finds it stored and only
        # tells the recorder and purges the delivery.
        await d.writer.settle()
        if not d.committed:
            with contextlib.suppress(Exception):
                await self.streams.purge_object_chunks(d.writer.subject)
        for m in d.held:
            with contextlib.suppress(Exception):
                await m.nak(delay=RETRY_DELAY_S)


def store_failed_message(key: Key, failing_s: float, error: Exception) -> str:
    """Why a job failed whose artifact the store could not write (the job's message)."""
    return (
        f"the artifact store could not store the job's {key.kind.value} artifact: its reads "
        f"and writes of the object store failed for {failing_s:.0f} s (last: {error!r}). "
        "A NATS server whose disk is full halts the object store's stream (its writes time "
        "out) until it is restarted with space: free space under its JetStream store "
        "directory, restart it, then resubmit the job"
    )
