"""Delivering an artifact to the artifact-store: chunks on a JetStream stream.

`deliver()` streams a file as chunks on `<prefix>.artifacts.<node>.<job>.<kind>`,
each with a message id (a retried publish is stored once) and an
ArtifactChunkHeader. Up to `WINDOW_CHUNKS` publishes are in flight at once
(about twice the throughput of waiting for each acknowledgement), fewer on
a slow link (`ChunkWindow`: the node's heartbeat, on the same connection,
waits behind every chunk in flight); a chunk not acknowledged within
`timeout_s` is published again under the same id. The last chunk goes out
only after every other is acknowledged, so when the artifact-store sees
it, the whole delivery is in the stream. transfer/packing.py packs the files.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO, Protocol

import msgspec
import nats.errors
from nats.js import JetStreamContext

from lorafleet import log
from lorafleet.artifacts import AsyncPublisher, NoStreamError, PublishRefusedError
from lorafleet.log import Event
from lorafleet.names import Header, Names, chunk_msg_id
from lorafleet.nats._natspy import client_of
from lorafleet_schemas.messages import ArtifactChunkHeader, ArtifactKind

#: Bytes of one chunk body; default 512 KiB (well below the default 1 MiB max payload).
DEFAULT_CHUNK_BYTES = 512 * 1024
#: Publishes awaiting an acknowledgement at once, at most (a fast link's window).
WINDOW_CHUNKS = 32
#: ... at first (it grows by one per acknowledgement that did not queue).
WINDOW_START_CHUNKS = 4
#: Seconds a chunk's acknowledgement may take beyond the fastest one seen
#: (time it queued behind the others, on the way or in the server) before
#: the window halves. Whatever else goes on the connection, the heartbeat
#: first, waits that long behind the chunks at most, far below the 3 s node
#: timeout: with a fixed 32 chunks (16 MiB) a 40 Mbit/s uplink queued a
#: beat for over 3 s, and a 64 kbit/s one with 1 KiB chunks lost its node
#: (tests/partition).
QUEUE_TARGET_S = 0.5
#: Chunks read from the file at once (in a thread), ahead of their publishes
#: (see ChunkReader for what it was measured to save).
READ_CHUNKS = 16
#: Seconds to wait for a chunk's acknowledgement before publishing it again.
ACK_TIMEOUT_S = 10.0
#: Seconds between looks at a reconnecting connection before a publish.
RECONNECT_POLL_S = 0.05
#: Times one chunk is published before the delivery fails.
MAX_TRIES = 4
#: Seconds to wait before publishing again after "no stream answered".
NO_STREAM_PAUSE_S = 0.5
#: Times one chunk answered "no stream" is published before the delivery
#: fails: a restarted server answers so until its streams are loaded, and on
#: a cluster a stream whose leader died does while it elects another (about
#: 5 s); 60 x 0.5 s = 30 s. The cost: a stream that is really missing is
#: reported 30 s late.
NO_STREAM_MAX_TRIES = 60
#: Smallest room left between a chunk body and the server's max payload; bytes.
#: A body of exactly max payload plus headers makes the server close the connection.
MIN_HEADROOM_BYTES = 16 * 1024

_encoder = msgspec.json.Encoder()


class DeliveryError(RuntimeError):
    """An artifact could not be delivered; the message says why and what to do."""


def chunk_size_for(chunk_bytes: int, max_payload: int) -> int:
    """`chunk_bytes`, clamped well below the server's `max_payload` (bytes)."""
    if chunk_bytes < 1:
        raise DeliveryError(f"chunk_bytes must be at least 1, not {chunk_bytes}")
    headroom = max(MIN_HEADROOM_BYTES, max_payload // 8)
    return max(1024, min(chunk_bytes, max_payload - headroom))


# --- packing -------------------------------------------------------------------


class ChunkPublisher(Protocol):
    """What the window publishes with (lorafleet.artifacts.AsyncPublisher)."""

    async def publish(
        self, subject: str, body: bytes, headers: dict[str, str] | None = None
    ) -> asyncio.Future[int]: ...


class Connection(Protocol):
    """The state of the connection the publishes go on (nats-py's Client)."""

    @property
    def is_connected(self) -> bool: ...

    @property
    def is_closed(self) -> bool: ...


def _placeholder() -> asyncio.Future[int]:
    """A chunk's future until its first publish replaces it."""
    return asyncio.get_running_loop().create_future()


@dataclass(slots=True)
class Chunk:
    """One chunk and its publish: the future of its acknowledgement, its tries."""

    seq: int
    body: bytes
    headers: dict[str, str]
    future: asyncio.Future[int] = field(default_factory=_placeholder)
    tries: int = 0
    #: Loop times of its last publish and of that publish's acknowledgement.
    sent_at: float = 0.0
    acked_at: float = 0.0

    def stamp_ack(self, future: asyncio.Future[int]) -> None:
        self.acked_at = asyncio.get_running_loop().time()


def _no_stream(fut: asyncio.Future[int]) -> bool:
    return fut.done() and not fut.cancelled() and isinstance(fut.exception(), NoStreamError)


def _refused(stream: str, what: str, seq: int, e: Exception) -> DeliveryError:
    if isinstance(e, NoStreamError):
        return DeliveryError(
            f"no JetStream stream took chunk {seq} of {what}: "
            f"is stream {stream} there (the services create it at start)?"
        )
    desc = e.description if isinstance(e, PublishRefusedError) else str(e)
    full = "maximum" in desc.lower() or "storage" in desc.lower()
    why = (
        f"the stream is full and refuses new chunks (DiscardPolicy.NEW): {desc}; "
        "free space in it or raise its limits, then deliver again"
        if full
        else desc
    )
    return DeliveryError(f"stream {stream} refused chunk {seq} of {what}: {why}")


class ChunkWindow:
    """Chunk publishes awaiting their acknowledgement, at most `window` at once.

    `push()` publishes a chunk and, once `window` are in flight, waits for the
    oldest. The window starts at WINDOW_START_CHUNKS and adapts to the link
    (`adapt`), between 1 and `size`: it grows by one with each
    acknowledgement that came as fast as the fastest seen (doubling each
    round trip, as TCP's slow start), and halves, once per window, when one
    queued for over QUEUE_TARGET_S; so a slow link holds about that much in
    flight, a fast one `size` chunks. `finish()` waits for every one, then
    publishes the last chunk and
    waits for it, so the last is in the stream only after all the others.
    A chunk without an acknowledgement within `timeout_s` is published again
    under its id, at most MAX_TRIES times.

    The republishing is the window's own protocol, not a generic retry: what
    lost one chunk (a reconnect) likely lost the rest of the window, so they
    all go again at once, each counting its own tries.
    """

    def __init__(
        self,
        publisher: ChunkPublisher,
        connection: Connection,
        *,
        subject: str,
        stream: str,
        what: str,
        timeout_s: float,
        size: int = WINDOW_CHUNKS,
        logger: Any = None,
    ) -> None:
        self.publisher = publisher
        self.connection = connection
        self.subject = subject
        self.stream = stream
        #: "the gguf artifact of job j1", for the messages.
        self.what = what
        self.timeout_s = timeout_s
        self.size = size
        self.window = min(size, WINDOW_START_CHUNKS)
        #: The fastest acknowledgement seen (s): the link's round trip, no queue.
        self.fastest_s = float("inf")
        #: No halving again until a chunk published after the last halving is acknowledged.
        self._halved_at_seq = -1
        self.in_flight: deque[Chunk] = deque()
        self.logger = logger or log.get(subject=subject)

    async def publish(self, chunk: Chunk) -> None:
        """Publish `chunk` (again), counting the try."""
        # While reconnecting, nats-py buffers publishes only up to its pending
        # size (2 MiB) and then raises: wait for the connection instead.
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.timeout_s * MAX_TRIES
        conn = self.connection
        while not conn.is_connected and not conn.is_closed and loop.time() < deadline:  # noqa: ASYNC110
            await asyncio.sleep(RECONNECT_POLL_S)
        chunk.tries += 1
        chunk.sent_at = loop.time()
        try:
            chunk.future = await self.publisher.publish(self.subject, chunk.body, chunk.headers)
            chunk.future.add_done_callback(chunk.stamp_ack)
        except nats.errors.Error as e:
            raise DeliveryError(f"publishing chunk {chunk.seq} of {self.what}: {e!r}") from e

    async def push(self, chunk: Chunk) -> None:
        """Publish `chunk`; with the window full, wait for the oldest chunks."""
        await self.publish(chunk)
        self.in_flight.append(chunk)
        while len(self.in_flight) >= self.window:
            await self.settle(self.in_flight.popleft())

    def adapt(self, chunk: Chunk, ack_s: float) -> None:
        """Grow or halve the window after `chunk` was acknowledged in `ack_s`."""
        self.fastest_s = min(self.fastest_s, ack_s)
        queued_s = ack_s - self.fastest_s
        if queued_s > QUEUE_TARGET_S:
            if chunk.seq > self._halved_at_seq:
                self.window = max(1, self.window // 2)
                # The newest published: still in flight, or `chunk` itself.
                self._halved_at_seq = max((c.seq for c in self.in_flight), default=chunk.seq)
        elif queued_s < QUEUE_TARGET_S / 2:
            self.window = min(self.size, self.window + 1)

    async def finish(self, last: Chunk) -> None:
        """Wait for every chunk in flight, then publish `last` and wait for it."""
        while self.in_flight:
            await self.settle(self.in_flight.popleft())
        await self.publish(last)
        await self.settle(last)

    async def settle(self, chunk: Chunk) -> None:
        """Wait for `chunk`'s acknowledgement, publishing it again when lost."""
        while True:
            try:
                await asyncio.wait_for(chunk.future, self.timeout_s)
                self.adapt(chunk, chunk.acked_at - chunk.sent_at)
                return
            except TimeoutError:
                if chunk.tries >= MAX_TRIES:
                    raise DeliveryError(
                        f"chunk {chunk.seq} of {self.what} was not acknowledged after "
                        f"{MAX_TRIES} tries of {self.timeout_s:g} s each: "
                        "is the NATS server reachable and the stream there?"
                    ) from None
                again = [chunk, *(c for c in self.in_flight if not c.future.done())]
                self.logger.warning(
                    Event.ARTIFACT_CHUNK,
                    seq=chunk.seq,
                    message=f"no ack; publishing {len(again)} chunks again",
                )
            except NoStreamError as e:
                # A restarted server answers "no responders" until its streams
                # are loaded, a cluster's stream while it elects a leader.
                if chunk.tries >= NO_STREAM_MAX_TRIES:
                    raise _refused(self.stream, self.what, chunk.seq, e) from None
                await asyncio.sleep(NO_STREAM_PAUSE_S)
                again = [chunk, *(c for c in self.in_flight if _no_stream(c.future))]
            except PublishRefusedError as e:
                raise _refused(self.stream, self.what, chunk.seq, e) from None
            for c in again:
                await self.publish(c)

    def abandon(self) -> None:
        """Stop waiting for what is still in flight (after an error: nobody will)."""
        for c in self.in_flight:
            if c.future.done() and not c.future.cancelled():
                c.future.exception()  # retrieved: asyncio would warn of it otherwise
            c.future.cancel()
        self.in_flight.clear()


class ChunkReader:
    """The file's chunks, read in a thread (the loop never waits on the disk),
    `read_chunks` at a time, in file order, a block ahead of the publishes.

    Measured delivering 200 MiB to a lone nats-server: a thread call per chunk
    (read and hash in it) cost the agent 0.30-0.31 CPU-s, one per 16 chunks
    with the hash on the loop 0.25-0.27 (and 0.30 s instead of 0.35 s).
    """

    def __init__(self, f: BinaryIO, step: int, count: int, read_chunks: int) -> None:
        self.f = f
        self.step = step
        self.count = count
        self.read_chunks = read_chunks
        self.asked = 0
        self.bodies: deque[bytes] = deque()
        self.ahead = self._read_ahead()

    def _read_ahead(self) -> asyncio.Future[bytes] | None:
        n = min(self.read_chunks, self.count - self.asked)
        if n <= 0:
            return None
        self.asked += n
        return asyncio.ensure_future(asyncio.to_thread(self.f.read, n * self.step))

    async def next_body(self) -> bytes | None:
        """The next chunk's bytes; None when the file has no more."""
        if not self.bodies:
            blob = await self.ahead if self.ahead is not None else b""
            self.ahead = self._read_ahead()
            self.bodies.extend(blob[i : i + self.step] for i in range(0, len(blob), self.step))
        return self.bodies.popleft() if self.bodies else None

    async def at_end(self) -> bool:
        """True when the file holds nothing past what was read."""
        return not await asyncio.to_thread(self.f.read, 1)

    async def close(self) -> None:
        if self.ahead is not None:
            with contextlib.suppress(Exception):
                await self.ahead
        self.f.close()


@dataclass(frozen=True, slots=True)
class ChunkHeaders:
    """The headers of one delivery's chunks: its Nats-Msg-Id and its ArtifactChunkHeader."""

    job_id: str
    node: str
    kind: ArtifactKind
    attempt: int
    #: A checkpoint's optimizer step (None for the other kinds).
    step: int | None = None

    def __call__(self, *, seq: int, **last: Any) -> dict[str, str]:
        """Chunk `seq`'s headers; `last` (last, count, size, sha256) on the last one."""
        h = ArtifactChunkHeader(
            job_id=self.job_id, node=self.node, kind=self.kind, attempt=self.attempt, seq=seq,
            step=self.step, **last,
        )  # fmt: skip
        return {
            Header.MSG_ID: chunk_msg_id(self.job_id, self.kind.value, self.attempt, seq, self.step),
            Header.CHUNK: _encoder.encode(h).decode(),
        }


async def _send(
    window: ChunkWindow, reader: ChunkReader, header: ChunkHeaders, path: Path, size: int
) -> str:
    """Every chunk of `path` through `window`; answers the sha256 of what was sent."""
    h = hashlib.sha256()
    sent = 0
    count, step = reader.count, reader.step
    for seq in range(count):
        body = await reader.next_body()
        if body is None:
            if seq or size:
                raise DeliveryError(f"{path} shrank while it was being delivered")
            body = b""  # an empty file is one empty chunk
        # Hashed on the loop: bounded CPU (about 0.3 ms per 512 KiB), and
        # cheaper than in the reading thread, whose GIL hand-offs cost more.
        h.update(body)
        sent += len(body)
        if seq < count - 1:
            if len(body) != step:
                raise DeliveryError(f"{path} shrank while it was being delivered")
            await window.push(Chunk(seq, body, header(seq=seq)))
            continue
        if not await reader.at_end() or sent != size:
            raise DeliveryError(f"{path} changed size while it was being delivered")
        digest = h.hexdigest()
        last = header(seq=seq, last=True, count=count, size=size, sha256=digest)
        await window.finish(Chunk(seq, body, last))
    return h.hexdigest()


async def deliver(
    js: JetStreamContext,
    names: Names,
    *,
    node: str,
    job_id: str,
    attempt: int,
    kind: ArtifactKind,
    path: Path,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    timeout_s: float = ACK_TIMEOUT_S,
    step: int | None = None,
) -> tuple[int, str]:
    """Deliver the file at `path` as the `kind` artifact of a job; return (size, sha256).

    step: a checkpoint's optimizer step (in each chunk's header and message id).
    chunk_bytes: bytes per chunk, default 512 KiB, clamped well below the
    server's max payload. timeout_s: seconds to wait for one chunk's
    acknowledgement before publishing it again (at most MAX_TRIES times);
    default 10. Raises DeliveryError when the stream refuses a chunk (full,
    missing) or never acknowledges it.
    """
    kind = ArtifactKind(kind)
    path = Path(path)
    nc = client_of(js)
    body_bytes = chunk_size_for(chunk_bytes, nc.max_payload)
    try:
        size = path.stat().st_size
    except OSError as e:
        raise DeliveryError(f"cannot read the {kind.value} artifact {path}: {e}") from None
    count = max(1, -(-size // body_bytes))
    started = time.perf_counter()
    logger = log.get(job_id=job_id, node=node, kind=kind.value, step=step)
    header = ChunkHeaders(job_id=job_id, node=node, kind=kind, attempt=attempt, step=step)
    pub = await AsyncPublisher(nc).start()
    window = ChunkWindow(
        pub,
        nc,
        subject=names.artifact_chunks(node, job_id, kind.value),
        stream=names.artifacts_stream,
        what=f"the {kind.value} artifact of job {job_id}",
        timeout_s=timeout_s,
        logger=logger,
    )
    f = await asyncio.to_thread(path.open, "rb")
    reader = ChunkReader(f, body_bytes, count, READ_CHUNKS)
    try:
        digest = await _send(window, reader, header, path, size)
    finally:
        window.abandon()
        await reader.close()
        await pub.stop()
    logger.info(
        Event.ARTIFACT_DELIVERED,
        size=size,
        sha256=digest,
        chunks=count,
        seconds=round(time.perf_counter() - started, 3),
    )
    return size, digest
