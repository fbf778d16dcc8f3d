"""Delivering an artifact to the artifact-store: chunks on a JetStream stream.

`deliver()` streams a file as chunks on `<prefix>.artifacts.<node>.<job>.<kind>`.
Each chunk carries `Nats-Msg-Id: <job>.<kind>.<attempt>.<seq>` (a retried
publish is stored once) and `Lorafleet-Chunk` (an ArtifactChunkHeader; the
last one also carries count, size and sha256). Up to `WINDOW_CHUNKS`
publishes are in flight at once (asynchronous publish: about twice the
throughput of waiting for each acknowledgement); a chunk without an
acknowledgement within `timeout_s` is published again under the same id.
The last chunk goes out only after every other chunk is acknowledged, so
when the artifact-store sees it, the whole delivery is in the stream.

`pack_adapter()` makes the `peft` artifact: a tar.gz of the adapter
directory that is the same bytes for the same files.
"""

from __future__ import annotations

import asyncio
import contextlib
import gzip
import hashlib
import os
import tarfile
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path

import msgspec
import nats.errors
from nats.js import JetStreamContext

from lorafleet import log
from lorafleet.artifacts import (
    CHUNK_HEADER,
    MSG_ID_HEADER,
    AsyncPublisher,
    NoStreamError,
    PublishRefusedError,
    msg_id,
)
from lorafleet.log import Event
from lorafleet.names import Names
from lorafleet_schemas.messages import ArtifactChunkHeader, ArtifactKind

#: Bytes of one chunk body; default 512 KiB (well below the default 1 MiB max payload).
DEFAULT_CHUNK_BYTES = 512 * 1024
#: Publishes awaiting an acknowledgement at once.
WINDOW_CHUNKS = 32
#: Chunks read from the file at once (in a thread), ahead of their publishes.
#: Measured delivering 200 MiB to a lone nats-server: a thread call per chunk
#: (read and hash in it) cost the agent 0.30-0.31 CPU-s, one per 16 chunks
#: with the hash on the loop 0.25-0.27 (and 0.30 s instead of 0.35 s).
READ_CHUNKS = 16
#: Times one chunk is published before the delivery fails.
MAX_TRIES = 4
#: Seconds to wait before publishing again after "no stream answered".
NO_STREAM_PAUSE_S = 0.5
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


def _tarinfo(name: str, *, is_dir: bool, size: int = 0) -> tarfile.TarInfo:
    ti = tarfile.TarInfo(name)
    ti.type = tarfile.DIRTYPE if is_dir else tarfile.REGTYPE
    ti.mode = 0o755 if is_dir else 0o644
    ti.size = size
    ti.mtime = 0
    ti.uid = ti.gid = 0
    ti.uname = ti.gname = ""
    return ti


def pack_adapter(adapter_dir: Path, out_file: Path) -> Path:
    """Pack `adapter_dir` into `out_file` as a tar.gz that is the same bytes for the same files.

    Names are sorted and relative, times, owners and modes are fixed, gzip
    carries no name or time. Links and other special files are refused.
    `out_file` appears only once complete.
    """
    adapter_dir = Path(adapter_dir)
    out_file = Path(out_file)
    if not adapter_dir.is_dir():
        raise DeliveryError(f"the adapter directory {adapter_dir} does not exist")
    entries: list[tuple[str, Path]] = []
    for root, dirs, files in os.walk(adapter_dir):
        dirs.sort()
        rel_root = Path(root).relative_to(adapter_dir)
        for name in sorted(dirs) + sorted(files):
            p = Path(root) / name
            if p.is_symlink() or not (p.is_dir() or p.is_file()):
                raise DeliveryError(
                    f"{p} is a link or a special file; an adapter holds only regular files"
                )
            entries.append(((rel_root / name).as_posix(), p))
    entries.sort(key=lambda e: e[0])
    tmp = out_file.with_name(f".{out_file.name}.part")
    out_file.parent.mkdir(parents=True, exist_ok=True)
    try:
        with (
            tmp.open("wb") as raw,
            gzip.GzipFile(filename="", mode="wb", fileobj=raw, mtime=0, compresslevel=6) as gz,
            tarfile.open(fileobj=gz, mode="w", format=tarfile.GNU_FORMAT) as tar,
        ):
            for name, p in entries:
                if p.is_dir():
                    tar.addfile(_tarinfo(name, is_dir=True))
                else:
                    with p.open("rb") as f:
                        tar.addfile(_tarinfo(name, is_dir=False, size=p.stat().st_size), f)
        os.replace(tmp, out_file)
    finally:
        tmp.unlink(missing_ok=True)
    return out_file


# --- delivery ------------------------------------------------------------------


@dataclass(slots=True)
class _InFlight:
    seq: int
    body: bytes
    headers: dict[str, str]
    future: asyncio.Future[int]
    tries: int = 1


def _future() -> asyncio.Future[int]:
    """A placeholder until the first publish replaces it."""
    return asyncio.get_running_loop().create_future()


def _no_stream(fut: asyncio.Future[int]) -> bool:
    return fut.done() and not fut.cancelled() and isinstance(fut.exception(), NoStreamError)


def _headers(
    job_id: str, kind: ArtifactKind, attempt: int, header: ArtifactChunkHeader
) -> dict[str, str]:
    return {
        MSG_ID_HEADER: msg_id(job_id, kind.value, attempt, header.seq),
        CHUNK_HEADER: _encoder.encode(header).decode(),
    }


def _refused(stream: str, job_id: str, kind: ArtifactKind, seq: int, e: Exception) -> DeliveryError:
    if isinstance(e, NoStreamError):
        return DeliveryError(
            f"no JetStream stream took chunk {seq} of the {kind.value} artifact of job {job_id}: "
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
    return DeliveryError(
        f"stream {stream} refused chunk {seq} of the {kind.value} artifact of job {job_id}: {why}"
    )


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
    timeout_s: float = 10.0,
) -> tuple[int, str]:
    """Deliver the file at `path` as the `kind` artifact of a job; return (size, sha256).

    chunk_bytes: bytes per chunk, default 512 KiB, clamped well below the
    server's max payload. timeout_s: seconds to wait for one chunk's
    acknowledgement before publishing it again (at most MAX_TRIES times);
    default 10. Raises DeliveryError when the stream refuses a chunk (full,
    missing) or never acknowledges it.
    """
    kind = ArtifactKind(kind)
    path = Path(path)
    subject = names.artifact_chunks(node, job_id, kind.value)
    stream = names.artifacts_stream
    # nats-py keeps the connection private on the context; the publishes go on it.
    nc = js._nc
    step = chunk_size_for(chunk_bytes, nc.max_payload)
    try:
        size = path.stat().st_size
    except OSError as e:
        raise DeliveryError(f"cannot read the {kind.value} artifact {path}: {e}") from None
    count = max(1, -(-size // step))
    logger = log.get(job_id=job_id, node=node, kind=kind.value)
    started = time.perf_counter()
    window: deque[_InFlight] = deque()

    def header(seq: int) -> ArtifactChunkHeader:
        return ArtifactChunkHeader(job_id=job_id, node=node, kind=kind, attempt=attempt, seq=seq)

    async def publish(item: _InFlight) -> None:
        # While reconnecting, nats-py buffers publishes only up to its pending
        # size (2 MiB) and then raises: wait for the connection instead.
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s * MAX_TRIES
        while not nc.is_connected and not nc.is_closed and loop.time() < deadline:  # noqa: ASYNC110
            await asyncio.sleep(0.05)
        try:
            item.future = await pub.publish(subject, item.body, item.headers)
        except nats.errors.Error as e:
            raise DeliveryError(
                f"publishing chunk {item.seq} of the {kind.value} artifact of job {job_id}: {e!r}"
            ) from e

    async def settle(item: _InFlight) -> None:
        while True:
            try:
                await asyncio.wait_for(item.future, timeout_s)
                return
            except TimeoutError:
                if item.tries >= MAX_TRIES:
                    raise DeliveryError(
                        f"chunk {item.seq} of the {kind.value} artifact of job {job_id} was not "
                        f"acknowledged after {MAX_TRIES} tries of {timeout_s:g} s each: "
                        "is the NATS server reachable and the stream there?"
                    ) from None
                # What was lost with this one (a reconnect) was likely lost with
                # the rest of the window: publish them all again now, not one
                # timeout after another.
                again = [item, *(w for w in window if not w.future.done())]
                logger.warning(
                    Event.ARTIFACT_CHUNK, seq=item.seq, message=f"no ack; publishing "
                    f"{len(again)} chunks again",
                )  # fmt: skip
                for w in again:
                    w.tries += 1
                    await publish(w)
            except NoStreamError as e:
                # A restarted server answers "no responders" until its streams are loaded.
                if item.tries >= MAX_TRIES:
                    raise _refused(stream, job_id, kind, item.seq, e) from None
                await asyncio.sleep(NO_STREAM_PAUSE_S)
                again = [item, *(w for w in window if _no_stream(w.future))]
                for w in again:
                    w.tries += 1
                    await publish(w)
            except PublishRefusedError as e:
                raise _refused(stream, job_id, kind, item.seq, e) from None

    h = hashlib.sha256()
    sent = 0
    asked = 0
    pub = await AsyncPublisher(nc).start()
    f = await asyncio.to_thread(path.open, "rb")

    def read_ahead() -> asyncio.Future[bytes] | None:
        # The file is read in a thread (the loop never waits on the disk), one
        # read of READ_CHUNKS chunks at a time, in file order, a block ahead
        # of the publishes.
        nonlocal asked
        n = min(READ_CHUNKS, count - asked)
        if n <= 0:
            return None
        asked += n
        return asyncio.ensure_future(asyncio.to_thread(f.read, n * step))

    bodies: deque[bytes] = deque()
    ahead = read_ahead()
    try:
        for seq in range(count):
            if not bodies:
                blob = await ahead if ahead is not None else b""
                ahead = read_ahead()
                bodies.extend(blob[i : i + step] for i in range(0, len(blob), step))
                if not bodies:
                    if seq or size:
                        raise DeliveryError(f"{path} shrank while it was being delivered")
                    bodies.append(b"")  # an empty file is one empty chunk
            body = bodies.popleft()
            # Hashed on the loop: bounded CPU (about 0.3 ms per 512 KiB), and
            # cheaper than in the reading thread, whose GIL hand-offs cost more.
            h.update(body)
            sent += len(body)
            if seq < count - 1:
                if len(body) != step:
                    raise DeliveryError(f"{path} shrank while it was being delivered")
                hdrs = _headers(job_id, kind, attempt, header(seq))
                item = _InFlight(seq, body, hdrs, _future())
                await publish(item)
                window.append(item)
                while len(window) >= WINDOW_CHUNKS:
                    await settle(window.popleft())
                continue
            if await asyncio.to_thread(f.read, 1) or sent != size:
                raise DeliveryError(f"{path} changed size while it was being delivered")
            while window:
                await settle(window.popleft())
            digest = h.hexdigest()
            last = ArtifactChunkHeader(
                job_id=job_id, node=node, kind=kind, attempt=attempt, seq=seq,
                last=True, count=count, size=size, sha256=digest,
            )  # fmt: skip
            item = _InFlight(seq, body, _headers(job_id, kind, attempt, last), _future())
            await publish(item)
            await settle(item)
    finally:
        for w in window:  # left behind by an error: nobody will wait for them
            if w.future.done() and not w.future.cancelled():
                w.future.exception()
            w.future.cancel()
        if ahead is not None:
            with contextlib.suppress(Exception):
                await ahead
        f.close()
        await pub.close()
    seconds = time.perf_counter() - started
    logger.info(
        Event.ARTIFACT_DELIVERED,
        size=size,
        sha256=digest,
        chunks=count,
        seconds=round(seconds, 3),
    )
    return size, digest
