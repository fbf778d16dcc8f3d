"""Artifacts on the bus: the chunk headers, the object store's format, and download.

Delivery (agent -> artifact-store) puts chunks on
`<prefix>.artifacts.<node>.<job>.<kind>` with two headers: `Nats-Msg-Id`
(`names.chunk_msg_id()`, so a retried publish is stored once) and `Lorafleet-Chunk`
(an ArtifactChunkHeader as JSON). The artifact-store commits each whole
artifact into the object store `<prefix>_artifacts` as `<job>/<kind>` (a job's checkpoints all as
`<job>/checkpoint`, each newer one replacing the one before), in
the NATS object store's own format, with lorafleet's fields in the object's
metadata: any NATS client downloads it (`nats object get lorafleet_artifacts
<job>/<kind>`).
"""

from __future__ import annotations

import contextlib
import datetime as dt
import hashlib
import os
from pathlib import Path

import msgspec
from nats.js import JetStreamContext
from nats.js.errors import NotFoundError

import lorafleet.names as _names
from lorafleet.names import Names, artifact_object_name
from lorafleet.nats._natspy import (
    AsyncPublisher,
    NoStreamError,
    ObjectChunksMissingError,
    ObjectDamagedError,
    PublishRefusedError,
    download_object,
    object_digest,
)
from lorafleet_schemas.messages import ArtifactKind, ArtifactRecord

__all__ = [
    "ArtifactChunkMissingError",
    "ArtifactDigestError",
    "ArtifactNotFoundError",
    "AsyncPublisher",
    "NoStreamError",
    "ObjectInfo",
    "PublishRefusedError",
    "decode_info",
    "download_artifact",
    "file_sha256",
    "get_record",
    "list_records",
    "object_digest",
    "read_info",
    "record_from_info",
]

#: Bytes read per step when hashing a file.
_HASH_STEP_BYTES = 1 << 20


class ArtifactNotFoundError(LookupError):
    """No stored artifact of that kind for that job."""


class ArtifactDigestError(ValueError):
    """What was downloaded is not what was stored (sha256 differs)."""


class ArtifactChunkMissingError(ArtifactDigestError):
    """A stored artifact's info names chunks the object store no longer holds."""


def chunk_missing_message(record: ArtifactRecord, bucket: str, why: str) -> str:
    """What a download of an artifact whose chunks are gone says, and what to do.

    Nothing re-sends it: an agent keeps no copy once the artifact-store has
    committed it, so the work is done again (a new job, or a resume).
    """
    again = (
        f"`lorafleet resume {record.job_id}` (if it failed or was cancelled) trains it "
        "again from its newest checkpoint"
        if record.kind is ArtifactKind.CHECKPOINT
        else f"submit job {record.job_id}'s spec again (`lorafleet submit`) to train it again"
    )
    return (
        f"job {record.job_id}: its {record.kind.value} artifact ({record.object} in {bucket}) "
        f"is listed but incomplete: {why}. Nothing was written. No agent keeps a copy to "
        f"send again: {again}"
    )


# --- the NATS object store's own format ---------------------------------------


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
    bucket = names.artifacts_bucket
    try:
        raw = await js.get_last_msg(
            _names.object_stream(bucket),
            _names.object_meta_subject(bucket, artifact_object_name(job_id, kind)),
        )
    except NotFoundError:
        return None
    return decode_info(raw.data or b"")


async def get_record(
    js: JetStreamContext, names: Names, job_id: str, kind: str
) -> ArtifactRecord | None:
    """The stored artifact's record, or None when it is not stored."""
    info = await read_info(js, names, job_id, kind)
    return None if info is None else record_from_info(info)


#: What a job made for its user; a checkpoint is for resuming, downloaded when asked for.
RESULTS: tuple[ArtifactKind, ...] = (ArtifactKind.PEFT, ArtifactKind.GGUF)
#: The file ending of each kind as downloaded: what its bytes are.
SUFFIXES: dict[ArtifactKind, str] = {
    ArtifactKind.PEFT: ".tar.gz",
    ArtifactKind.GGUF: ".gguf",
    ArtifactKind.CHECKPOINT: ".tar",
}


def download_name(job_id: str, kind: ArtifactKind) -> str:
    """`<job>-<kind><suffix>`: the file a download writes."""
    return f"{job_id}-{kind.value}{SUFFIXES[kind]}"


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

    The bytes go straight into a file (objects.download_object). `out_file`
    appears only once whole and verified; raises ArtifactNotFoundError,
    ArtifactChunkMissingError (the object store lost some of its chunks:
    the message names them and what to do) or ArtifactDigestError.
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
        with tmp.open("wb") as f:
            try:
                got = await download_object(js, names.artifacts_bucket, record.object, f)
            except ObjectChunksMissingError as e:
                raise ArtifactChunkMissingError(
                    chunk_missing_message(record, names.artifacts_bucket, e.detail)
                ) from None
            except ObjectDamagedError as e:
                raise ArtifactDigestError(str(e)) from None
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
