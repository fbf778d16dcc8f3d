"""Artifacts on the bus: the chunk headers, the object store's format, and download.

Delivery (agent -> artifact-store) puts chunks on
`<prefix>.artifacts.<node>.<job>.<kind>` with two headers: `Nats-Msg-Id`
(`msg_id()`, so a retried publish is stored once) and `Lorafleet-Chunk`
(an ArtifactChunkHeader as JSON). The artifact-store commits each whole
artifact into the object store `<prefix>_artifacts` as `<job>/<kind>`, in
the NATS object store's own format, with lorafleet's fields in the object's
metadata: any NATS client downloads it (`nats object get lorafleet_artifacts
<job>/<kind>`).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import datetime as dt
import hashlib
import os
from pathlib import Path

import msgspec
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.js import JetStreamContext
from nats.js.errors import NotFoundError

from lorafleet.names import Names, artifact_object_name
from lorafleet_schemas.messages import ArtifactKind, ArtifactRecord

#: The header that carries an ArtifactChunkHeader as JSON.
CHUNK_HEADER = "Lorafleet-Chunk"
#: JetStream's de-duplication header.
MSG_ID_HEADER = "Nats-Msg-Id"
#: Bytes read per step when hashing a file.
_HASH_STEP_BYTES = 1 << 20


class ArtifactNotFoundError(LookupError):
    """No stored artifact of that kind for that job."""


class ArtifactDigestError(ValueError):
    """What was downloaded is not what was stored (sha256 differs)."""


def msg_id(job_id: str, kind: str, attempt: int, seq: int) -> str:
    """The Nats-Msg-Id of one chunk: a retried publish of it is stored once."""
    return f"{job_id}.{kind}.{attempt}.{seq}"


# --- asynchronous JetStream publish ------------------------------------------


class PublishRefusedError(Exception):
    """JetStream answered a publish with an error (a full stream, a wrong subject, ...)."""

    def __init__(self, description: str, code: int = 0, err_code: int = 0) -> None:
        super().__init__(description)
        self.description = description
        self.code = code
        self.err_code = err_code


class NoStreamError(PublishRefusedError):
    """No stream took the publish (no responders)."""


class _PubError(msgspec.Struct):
    code: int = 0
    err_code: int = 0
    description: str = ""


class _PubReply(msgspec.Struct):
    error: _PubError | None = None
    seq: int = 0
    duplicate: bool = False


class AsyncPublisher:
    """JetStream publishes whose acknowledgements are collected on one inbox.

    `publish()` returns a future of the stored message's stream sequence,
    or of PublishRefusedError. (nats-py's own publish_async raises a
    stream's refusal inside its reply callback, so its future never ends.)
    Cancel a future to stop waiting for it.
    """

    def __init__(self, nc: Client) -> None:
        self._nc = nc
        self._prefix = ""
        self._sub: Subscription | None = None
        self._futures: dict[str, asyncio.Future[int]] = {}
        self._next = 0

    async def start(self) -> AsyncPublisher:
        self._prefix = self._nc.new_inbox()
        self._sub = await self._nc.subscribe(self._prefix + ".*", cb=self._on_reply)
        return self

    async def close(self) -> None:
        for fut in list(self._futures.values()):
            fut.cancel()
        self._futures.clear()
        if self._sub is not None:
            with contextlib.suppress(Exception):
                await self._sub.unsubscribe()
            self._sub = None

    async def __aenter__(self) -> AsyncPublisher:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def publish(
        self, subject: str, body: bytes, headers: dict[str, str] | None = None
    ) -> asyncio.Future[int]:
        if self._sub is None:
            raise RuntimeError("AsyncPublisher.start() first")
        self._next += 1
        token = str(self._next)
        fut: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        self._futures[token] = fut
        fut.add_done_callback(lambda _: self._futures.pop(token, None))
        await self._nc.publish(subject, body, reply=f"{self._prefix}.{token}", headers=headers)
        return fut

    async def _on_reply(self, msg: Msg) -> None:
        fut = self._futures.pop(msg.subject[len(self._prefix) + 1 :], None)
        if fut is None or fut.done():
            return
        if msg.headers and msg.headers.get("Status") == "503":
            fut.set_exception(NoStreamError("no stream answered (no responders)", 503))
            return
        try:
            reply = msgspec.json.decode(msg.data, type=_PubReply)
        except msgspec.DecodeError:
            fut.set_exception(PublishRefusedError(f"not a JetStream reply: {msg.data[:200]!r}"))
            return
        if reply.error is not None:
            e = reply.error
            fut.set_exception(PublishRefusedError(e.description, e.code, e.err_code))
        else:
            fut.set_result(reply.seq)


# --- the NATS object store's own format ---------------------------------------


def object_stream(names: Names) -> str:
    """The stream behind the artifacts object store."""
    return f"OBJ_{names.artifacts_bucket}"


def object_meta_subject(names: Names, job_id: str, kind: str) -> str:
    name = artifact_object_name(job_id, kind)
    return f"$O.{names.artifacts_bucket}.M.{base64.urlsafe_b64encode(name.encode()).decode()}"


def object_chunk_subject(names: Names, nuid: str) -> str:
    return f"$O.{names.artifacts_bucket}.C.{nuid}"


def object_digest(sha256_hex: str) -> str:
    """The object store's digest field for a sha256 (`SHA-256=<base64url>`)."""
    return "SHA-256=" + base64.urlsafe_b64encode(bytes.fromhex(sha256_hex)).decode()


class ObjectInfo(msgspec.Struct):
    """The fields of an object info message that lorafleet reads."""

    name: str
    bucket: str = ""
    nuid: str = ""
    size: int = 0
    chunks: int = 0
    digest: str = ""
    deleted: bool = False
    metadata: dict[str, str] = msgspec.field(default_factory=dict)


def decode_info(data: bytes) -> ObjectInfo | None:
    """An object info message, or None when it is not one."""
    try:
        return msgspec.json.decode(data, type=ObjectInfo)
    except msgspec.DecodeError:
        return None


def record_from_info(info: ObjectInfo) -> ArtifactRecord | None:
    """The ArtifactRecord an object's metadata describes; None for a deleted or foreign object."""
    md = info.metadata
    if info.deleted or "sha256" not in md or "job_id" not in md:
        return None
    try:
        return ArtifactRecord(
            job_id=md["job_id"],
            kind=ArtifactKind(md["kind"]),
            node=md.get("node", ""),
            object=info.name,
            size=info.size,
            sha256=md["sha256"],
            base_model=md.get("base_model", ""),
            stored_at=dt.datetime.fromisoformat(md["stored_at"].replace("Z", "+00:00")),
        )
    except (KeyError, ValueError):
        return None


async def read_info(
    js: JetStreamContext, names: Names, job_id: str, kind: str
) -> ObjectInfo | None:
    """The stored object's info (deleted ones included), or None when there is none."""
    try:
        raw = await js.get_last_msg(object_stream(names), object_meta_subject(names, job_id, kind))
    except NotFoundError:
        return None
    return decode_info(raw.data or b"")


async def get_record(
    js: JetStreamContext, names: Names, job_id: str, kind: str
) -> ArtifactRecord | None:
    """The stored artifact's record, or None when it is not stored."""
    info = await read_info(js, names, job_id, kind)
    return None if info is None else record_from_info(info)


async def list_records(js: JetStreamContext, names: Names, job_id: str) -> list[ArtifactRecord]:
    """Every stored artifact of a job, in ArtifactKind order."""
    out = []
    for kind in ArtifactKind:
        rec = await get_record(js, names, job_id, kind.value)
        if rec is not None:
            out.append(rec)
    return out


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(_HASH_STEP_BYTES):
            h.update(block)
    return h.hexdigest()


async def download_artifact(
    js: JetStreamContext, names: Names, job_id: str, kind: ArtifactKind | str, out_file: Path
) -> ArtifactRecord:
    """Write a stored artifact into `out_file` and check its sha256.

    The bytes go into a file handed to nats-py (its plain `get` grows one
    buffer and copies it per chunk, quadratic in the size). `out_file`
    appears only once whole and verified; raises ArtifactNotFoundError or
    ArtifactDigestError.
    """
    kind = ArtifactKind(kind)
    record = await get_record(js, names, job_id, kind.value)
    if record is None:
        raise ArtifactNotFoundError(
            f"job {job_id} has no stored {kind.value} artifact "
            f"(object {artifact_object_name(job_id, kind.value)} in {names.artifacts_bucket})"
        )
    out_file = Path(out_file)
    out_file.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_file.with_name(f".{out_file.name}.part")
    try:
        obs = await js.object_store(names.artifacts_bucket)
        with tmp.open("wb") as f:
            await obs.get(record.object, writeinto=f)
        got = file_sha256(tmp)
        if got != record.sha256 or tmp.stat().st_size != record.size:
            raise ArtifactDigestError(
                f"{record.object}: downloaded {tmp.stat().st_size} bytes with sha256 {got}, "
                f"but {record.size} bytes with sha256 {record.sha256} were stored"
            )
        os.replace(tmp, out_file)
    finally:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
    return record
