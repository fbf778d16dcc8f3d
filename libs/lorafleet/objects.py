"""Reading and writing objects of a NATS object store.

`read_object` reads with two JetStream API calls only (a message get and
batched direct gets on `OBJ_<bucket>`), so a node whose credentials allow
just `names.object_read_subjects(bucket)` can read datasets, and the checkpoint or
adapter a resumed job starts from; `download_object` uses nats-py's own
get, written into a file (for users that may do more). Both
work around nats-py and live in lorafleet.nats._natspy; this is their public face.

`listed_objects`, `touch_object` and `remove_object` are retention's
(lorafleet.retention): an object is removed only if its info is still the
one a sweep judged (a compare-and-set on the info's sequence), and whoever
makes a new reference to a stored object touches it first (a new info, the
same bytes), so a sweep that judged it before cannot remove it after.

`ObjectWriter` publishes an object's chunks with a window of
acknowledgements in flight (nats-py's `put` waits for each chunk's before
the next: a round trip per chunk). `StagedObject` writes an object whose
data is still arriving and whose name is known only at its end: its
chunks go out as they come, under a subject no object names, and the
object exists from `commit` on (its info message); `discard` purges them.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import hashlib
import json
from collections import deque
from dataclasses import dataclass

import msgspec
import nats.js.errors
from nats.js import JetStreamContext
from nats.js.errors import NotFoundError
from nats.nuid import NUID

import lorafleet.log as log
from lorafleet.artifacts import decode_info, object_digest
from lorafleet.names import (
    ROLLUP_SUBJECT,
    Header,
    object_chunk_subject,
    object_meta_subject,
    object_meta_subjects,
    object_stream,
)
from lorafleet.nats._natspy import (
    AsyncPublisher,
    ObjectDamagedError,
    ObjectNotFoundError,
    client_of,
    download_object,
    read_object,
    read_object_sha256,
    subject_counts,
)

__all__ = [
    "WRITE_ACK_TIMEOUT_S",
    "WRITE_WINDOW",
    "ListedObject",
    "ObjectDamagedError",
    "ObjectNotFoundError",
    "ObjectWriter",
    "StagedObject",
    "download_object",
    "listed_objects",
    "read_object",
    "read_object_sha256",
    "remove_object",
    "touch_object",
]

#: Object chunk publishes awaiting their acknowledgement at once.
WRITE_WINDOW = 64
#: Seconds to wait for one object chunk's acknowledgement.
WRITE_ACK_TIMEOUT_S = 30.0
#: Bytes of a StagedObject's chunk: under the server's 1 MiB max payload,
#: a quarter of the messages (and of a reader's message gets) of nats-py's
#: 128 KiB (bench/gateway.py measured both).
STAGED_CHUNK_BYTES = 512 * 1024


class ObjectWriter:
    """One object's chunks, published in order on `subject` with at most
    WRITE_WINDOW awaiting their acknowledgement."""

    def __init__(
        self, publisher: AsyncPublisher, subject: str, ack_timeout_s: float = WRITE_ACK_TIMEOUT_S
    ) -> None:
        self.subject = subject
        #: Seconds a write's acknowledgement may take.
        self.ack_timeout_s = ack_timeout_s
        self.chunks_written = 0
        #: Bytes of the largest chunk written (the info's max_chunk_size).
        self.max_chunk = 0
        self._publisher = publisher
        self._writes: deque[asyncio.Future[int]] = deque()

    async def write(self, data: bytes) -> None:
        self.max_chunk = max(self.max_chunk, len(data))
        self._writes.append(await self._publisher.publish(self.subject, data))
        self.chunks_written += 1
        while len(self._writes) >= WRITE_WINDOW:
            await asyncio.wait_for(self._writes.popleft(), self.ack_timeout_s)

    async def flush(self) -> None:
        """Wait for every write's acknowledgement; raises the first refused or late one."""
        while self._writes:
            await asyncio.wait_for(self._writes.popleft(), self.ack_timeout_s)

    async def settle(self) -> None:
        """Let every write in flight land or fail (so that a purge comes after them).

        One ack timeout for them all, not one each: they were sent together,
        and on a halted stream (a full disk) each would take all of it."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.ack_timeout_s
        while self._writes:
            with contextlib.suppress(Exception):
                left_s = max(0.0, deadline - loop.time())
                await asyncio.wait_for(self._writes.popleft(), left_s)


class StagedObject:
    """An object of `bucket` written as its bytes arrive, named at `commit`.

    Until then no info message names its chunks: the bucket lists nothing
    and a get of any name finds nothing. Use as `async with`: leaving the
    block without a commit discards what was written (which needs the
    right to purge the bucket's stream). A process killed meanwhile leaves
    the chunks behind, as nats-py's own put does.
    """

    def __init__(
        self, js: JetStreamContext, bucket: str, chunk_bytes: int = STAGED_CHUNK_BYTES
    ) -> None:
        self.js = js
        self.bucket = bucket
        self.chunk_bytes = chunk_bytes
        self.nuid = NUID().next().decode()
        self.size = 0
        self._sha = hashlib.sha256()
        self._pending = bytearray()
        self._publisher = AsyncPublisher(client_of(js))
        self._writer = ObjectWriter(self._publisher, object_chunk_subject(bucket, self.nuid))
        self._committed = False

    async def __aenter__(self) -> StagedObject:
        await self._publisher.start()
        return self

    async def __aexit__(self, exc_type: object, *_: object) -> None:
        try:
            if not self._committed:
                await self.discard()
        except Exception as e:
            if exc_type is None:
                raise
            # The error that ended the block is the one to tell; the chunks
            # stay behind, as a killed writer's do.
            log.get().warning(log.Event.REQUEST_FAILED, message="discard", error=repr(e))
        finally:
            await self._publisher.stop()

    def sha256(self) -> str:
        """The hex sha256 of every byte written so far."""
        return self._sha.hexdigest()

    async def write(self, data: bytes) -> None:
        self._sha.update(data)
        self.size += len(data)
        self._pending += data
        while len(self._pending) >= self.chunk_bytes:
            chunk = bytes(self._pending[: self.chunk_bytes])
            del self._pending[: self.chunk_bytes]
            await self._writer.write(chunk)

    async def commit(self, name: str) -> None:
        """Make the object `name` of what was written. A live object of that
        name and size is taken for these bytes already (names are content
        hashes where this is used): it stays, and this copy is discarded."""
        if self._pending:
            await self._writer.write(bytes(self._pending))
            self._pending.clear()
        await self._writer.flush()
        meta = object_meta_subject(self.bucket, name)
        held = None
        with contextlib.suppress(NotFoundError):
            held = decode_info(
                (await self.js.get_last_msg(object_stream(self.bucket), meta)).data or b""
            )
        # A stored one is touched, not left as it was: a retention sweep that
        # judged it unneeded cannot remove it now (the module's doc).
        stored = held is not None and not held.deleted and held.size == self.size
        if stored and await touch_object(self.js, self.bucket, name):
            await self.discard()
            self._committed = True
            return
        stamp = dt.datetime.now(dt.UTC).isoformat().replace("+00:00", "Z")
        info = {
            "name": name, "bucket": self.bucket, "nuid": self.nuid, "size": self.size,
            "chunks": self._writer.chunks_written, "mtime": stamp,
            "digest": object_digest(self.sha256()),
            "options": {"max_chunk_size": self.chunk_bytes},
        }  # fmt: skip
        await self.js.publish(
            meta, json.dumps(info).encode(), headers={Header.ROLLUP: ROLLUP_SUBJECT}
        )
        self._committed = True

    async def discard(self) -> None:
        """Purge the chunks written (after letting those in flight land)."""
        await self._writer.settle()
        await self.js.purge_stream(
            object_stream(self.bucket), subject=object_chunk_subject(self.bucket, self.nuid)
        )


# --- retention ---------------------------------------------------------------------

#: JetStream's error code for a publish whose expected last subject sequence
#: is not the subject's (a compare-and-set that lost).
WRONG_LAST_SEQUENCE_ERR = 10071


@dataclass(frozen=True)
class ListedObject:
    """A live object of a bucket, as its info message says."""

    name: str
    size: int
    nuid: str
    #: The stream sequence of its info message: a touch or a rewrite changes it.
    seq: int


async def listed_objects(js: JetStreamContext, bucket: str) -> list[ListedObject]:
    """Every live object of `bucket` (deleted ones left out; none without the bucket)."""
    stream = object_stream(bucket)
    try:
        metas = await subject_counts(js, stream, object_meta_subjects(bucket))
    except NotFoundError:
        return []
    out = []
    for subject in sorted(metas):
        with contextlib.suppress(NotFoundError):
            raw = await js.get_last_msg(stream, subject)
            info = decode_info(raw.data or b"")
            if info is not None and not info.deleted and raw.seq is not None:
                out.append(ListedObject(info.name, info.size, info.nuid, raw.seq))
    return out


async def _republish_info(
    js: JetStreamContext, bucket: str, name: str, change: dict[str, object], expected_seq: int
) -> bool:
    """The info of `name` again with `change`, only if its message is still
    `expected_seq`; False when it is not (changed, or gone)."""
    stream, meta = object_stream(bucket), object_meta_subject(bucket, name)
    try:
        raw = await js.get_last_msg(stream, meta)
    except NotFoundError:
        return False
    if raw.seq != expected_seq:
        return False
    info = msgspec.json.decode(raw.data or b"{}", type=dict[str, object])
    if info.get("deleted"):
        return False
    headers = {Header.ROLLUP: ROLLUP_SUBJECT, Header.EXPECTED_LAST_SUBJECT_SEQUENCE: str(raw.seq)}
    try:
        await js.publish(meta, json.dumps({**info, **change}).encode(), headers=headers)
    except nats.js.errors.APIError as e:
        if e.err_code == WRONG_LAST_SEQUENCE_ERR:
            return False
        raise
    return True


async def touch_object(js: JetStreamContext, bucket: str, name: str) -> bool:
    """Write the live object `name`'s info again (a new sequence, a new
    mtime, the same bytes); False when there is no live object to touch.

    Called before a new reference to a stored object is recorded: a
    retention sweep that judged the old info unneeded then removes nothing
    (`remove_object`'s compare-and-set), and the next sweep sees the reference.
    """
    stream, meta = object_stream(bucket), object_meta_subject(bucket, name)
    for _ in range(3):  # another touch between the read and the write: read again
        try:
            raw = await js.get_last_msg(stream, meta)
        except NotFoundError:
            return False
        info = decode_info(raw.data or b"")
        if info is None or info.deleted or raw.seq is None:
            return False
        stamp = dt.datetime.now(dt.UTC).isoformat().replace("+00:00", "Z")
        if await _republish_info(js, bucket, name, {"mtime": stamp}, raw.seq):
            return True
    return False


async def remove_object(js: JetStreamContext, bucket: str, obj: ListedObject) -> bool:
    """Delete `obj` if its info is still the one listed: a deleted info in its
    place (as nats-py's delete writes), then its chunks purged. False (nothing
    done) when it changed since (touched, rewritten) or is gone already."""
    gone = {"deleted": True, "size": 0, "chunks": 0, "digest": ""}
    if not await _republish_info(js, bucket, obj.name, gone, obj.seq):
        return False
    await js.purge_stream(object_stream(bucket), subject=object_chunk_subject(bucket, obj.nuid))
    return True
