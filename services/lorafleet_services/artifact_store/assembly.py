"""Chunk assembly and verification, and the delivery rules: plain code, no bus.

`Assembly` takes an artifact's chunks in any order and any number of times,
hands back the bytes that have become contiguous (so the caller streams them
into the object store while the delivery goes on), and once the last chunk
is known and nothing is missing says whether count, size and sha256 agree.
Beside it, the rules: who may deliver (`delivery_refusal_reason`), whether
the object is stored already (`is_stored`), whether a checkpoint may replace
the stored one (`superseded`), whether the recorder is owed a report
(`report_owed`), which deliveries ended (`EndedDeliveries`).
"""

from __future__ import annotations

import datetime as dt
import hashlib
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeGuard

import msgspec

from lorafleet.artifacts import ObjectInfo, object_digest
from lorafleet.names import Header, InvalidNameError, Names, artifact_object_name
from lorafleet.states import ON_NODE
from lorafleet_schemas.messages import ArtifactChunkHeader, ArtifactKind, JobRecord, JobState

#: Deliveries remembered as ended, so late duplicates are dropped.
FINISHED_MEMORY = 4096
#: Chunks held while waiting for an earlier one; bytes. A delivery that
#: needs more is corrupt (the agent keeps a small window), not worth the memory.
MAX_PENDING_BYTES = 256 * 1024 * 1024


class Hasher(Protocol):
    def update(self, data: bytes, /) -> None: ...
    def hexdigest(self) -> str: ...


class ChunkError(ValueError):
    """A message on the artifacts stream that is not a well-formed chunk."""


class AssemblyError(ValueError):
    """A delivery that cannot be a whole artifact (missing, extra or corrupt chunks)."""


@dataclass(frozen=True, slots=True)
class Key:
    """One delivery: the same artifact of the same attempt of a job (and, for
    a checkpoint, of the same step: an attempt delivers many)."""

    node: str
    job_id: str
    kind: ArtifactKind
    attempt: int
    #: A checkpoint's optimizer step; 0 for the other kinds.
    step: int = 0

    @property
    def is_checkpoint(self) -> bool:
        return self.kind is ArtifactKind.CHECKPOINT

    @property
    def label(self) -> str:
        if self.is_checkpoint:
            return (
                f"the checkpoint at step {self.step} of job {self.job_id} (attempt {self.attempt})"
            )
        return f"the {self.kind.value} artifact of job {self.job_id} (attempt {self.attempt})"


@dataclass(frozen=True, slots=True)
class Chunk:
    key: Key
    header: ArtifactChunkHeader
    subject: str


def subject_parts(names: Names, subject: str) -> tuple[str, str, str]:
    """(node, job, kind) of a chunk subject, or ChunkError."""
    try:
        return names.artifact_chunks_parts(subject)
    except InvalidNameError as e:
        raise ChunkError(str(e)) from None


_header_decoder = msgspec.json.Decoder(ArtifactChunkHeader)


def parse_chunk(names: Names, subject: str, headers: dict[str, str] | None) -> Chunk:
    """The chunk a message is, checked against its subject; ChunkError if it is none."""
    node, job_id, kind = subject_parts(names, subject)
    raw = (headers or {}).get(Header.CHUNK)
    if raw is None:
        raise ChunkError(f"a message on {subject} has no {Header.CHUNK} header")
    try:
        header = _header_decoder.decode(raw)
    except msgspec.DecodeError as e:
        raise ChunkError(f"the {Header.CHUNK} header on {subject} is not valid: {e}") from None
    if (header.node, header.job_id, header.kind.value) != (node, job_id, kind):
        raise ChunkError(
            f"the chunk header names {header.node}/{header.job_id}/{header.kind.value} "
            f"but was published on {subject}"
        )
    if header.last and (header.count is None or header.size is None or header.sha256 is None):
        raise ChunkError(f"the last chunk on {subject} lacks its count, size or sha256")
    if header.last and header.count is not None and header.seq != header.count - 1:
        raise ChunkError(
            f"the last chunk on {subject} has seq {header.seq} but says the count is {header.count}"
        )
    step = 0
    if header.kind is ArtifactKind.CHECKPOINT:
        if header.step is None or header.step < 0:
            raise ChunkError(f"a checkpoint chunk on {subject} lacks its step (or it is negative)")
        step = header.step
    return Chunk(Key(node, job_id, header.kind, header.attempt, step), header, subject)


@dataclass(frozen=True, slots=True)
class VerifiedArtifact:
    """A verified artifact: its size (bytes), sha256 and chunk count."""

    size: int
    sha256: str
    count: int


@dataclass(slots=True)
class Assembly:
    """Chunks of one delivery, put in order as they come.

    `add` returns the bodies that are now next in order (feed them to the
    object store in that order); duplicates return nothing.
    """

    key: Key
    next_seq: int = 0
    size: int = 0
    pending: dict[int, bytes] = field(default_factory=dict)
    pending_bytes: int = 0
    last: ArtifactChunkHeader | None = None
    #: Stream sequence of the newest chunk seen (for purging up to it).
    stream_seq: int = 0
    #: Anything with hashlib's update() and hexdigest(); default sha256.
    hasher: Hasher = field(default_factory=hashlib.sha256)

    def add(self, header: ArtifactChunkHeader, body: bytes, stream_seq: int = 0) -> list[bytes]:
        self.stream_seq = max(self.stream_seq, stream_seq)
        if header.last:
            if self.last is not None and (self.last.count, self.last.size, self.last.sha256) != (
                header.count,
                header.size,
                header.sha256,
            ):
                raise AssemblyError(
                    f"{self.key.label}: two last chunks disagree (count {self.last.count} "
                    f"vs {header.count}, size {self.last.size} vs {header.size})"
                )
            self.last = header
        if self.last is not None and self.last.count is not None and header.seq >= self.last.count:
            raise AssemblyError(
                f"{self.key.label}: chunk {header.seq} is beyond the count {self.last.count} "
                "that the last chunk gives"
            )
        if header.seq < self.next_seq or header.seq in self.pending:
            return []
        if header.seq > self.next_seq:
            self.pending_bytes += len(body)
            if self.pending_bytes > MAX_PENDING_BYTES:
                raise AssemblyError(
                    f"{self.key.label}: more than {MAX_PENDING_BYTES >> 20} MiB of chunks "
                    f"arrived ahead of the missing chunk {self.next_seq}"
                )
            self.pending[header.seq] = body
            return []
        ready = [body]
        self._take(body)
        while self.next_seq in self.pending:
            nxt = self.pending.pop(self.next_seq)
            self.pending_bytes -= len(nxt)
            ready.append(nxt)
            self._take(nxt)
        return ready

    def _take(self, body: bytes) -> None:
        self.hasher.update(body)
        self.size += len(body)
        self.next_seq += 1

    @property
    def has_last(self) -> bool:
        return self.last is not None

    def missing(self) -> list[int]:
        """Chunk numbers not yet seen, once the last chunk says how many there are."""
        if self.last is None or self.last.count is None:
            return []
        return [s for s in range(self.next_seq, self.last.count) if s not in self.pending]

    @property
    def complete(self) -> bool:
        return self.last is not None and self.next_seq == self.last.count

    def verify(self) -> VerifiedArtifact:
        """The whole artifact, or AssemblyError saying what is wrong with it."""
        last = self.last
        if last is None or last.count is None or last.size is None or last.sha256 is None:
            raise AssemblyError(f"{self.key.label}: the last chunk has not arrived")
        gaps = self.missing()
        if gaps:
            shown = ", ".join(str(s) for s in gaps[:10]) + (", ..." if len(gaps) > 10 else "")
            raise AssemblyError(
                f"{self.key.label} is short: {len(gaps)} of its {last.count} chunks never "
                f"arrived (chunk {shown})"
            )
        extra = sorted(s for s in self.pending if s >= last.count)
        if extra:
            raise AssemblyError(
                f"{self.key.label}: chunk {extra[0]} is beyond the count {last.count} "
                "that the last chunk gives"
            )
        if self.size != last.size:
            raise AssemblyError(
                f"{self.key.label} is {self.size} bytes, but the delivery said {last.size}"
            )
        digest = self.hasher.hexdigest()
        if digest != last.sha256:
            raise AssemblyError(
                f"{self.key.label} is corrupt: its sha256 is {digest}, but the delivery said "
                f"{last.sha256}"
            )
        return VerifiedArtifact(size=self.size, sha256=digest, count=last.count)


class EndedDeliveries:
    """Keys of deliveries that ended, the newest `size` of them (insertion order)."""

    def __init__(self, size: int = FINISHED_MEMORY) -> None:
        self.size = size
        self._keys: dict[Key, None] = {}

    def add(self, key: Key) -> None:
        self._keys[key] = None
        while len(self._keys) > self.size:
            self._keys.pop(next(iter(self._keys)))

    def __contains__(self, key: object) -> bool:
        return key in self._keys

    def __len__(self) -> int:
        return len(self._keys)


#: The states in which a job's node may deliver a checkpoint: while it
#: trains, and after (a delivery that started while it trained ends later);
#: not while it is starting, before the node has taken it up.
CHECKPOINT_STATES: frozenset[JobState] = ON_NODE - {JobState.STARTING}


def delivery_refusal_reason(job: JobRecord | None, key: Key) -> str | None:
    """Why `key.node` may not deliver this artifact now, or None when it may.

    A node delivers only for a job on it, for the job's current attempt,
    while the job is on a node, and only kinds the job makes; a checkpoint
    (which every job may make, and which never gates `done`) only while the
    job is in CHECKPOINT_STATES.
    """
    if job is None:
        return f"job {key.job_id} does not exist"
    if job.node != key.node:
        return f"job {key.job_id} is assigned to node {job.node!r}, not {key.node!r}"
    if job.attempt != key.attempt:
        return (
            f"job {key.job_id} is on attempt {job.attempt}, "
            f"the delivery is of attempt {key.attempt}"
        )
    if job.state not in ON_NODE:
        return f"job {key.job_id} is {job.state.value}: it takes no artifacts"
    if key.is_checkpoint:
        if job.state not in CHECKPOINT_STATES:
            return f"job {key.job_id} is {job.state.value}: it takes no checkpoint yet"
        return None
    if key.kind not in job.artifacts_expected:
        return (
            f"job {key.job_id} makes {', '.join(k.value for k in job.artifacts_expected)}, "
            f"not {key.kind.value}"
        )
    return None


# --- the object store's own format (so `nats object get` reads what we write) ---


def object_chunk_token(key: Key, writer: str) -> str:
    """The `nuid` of an object being written: its chunks go on `$O.<bucket>.C.<token>`.

    One per writer (`writer` is random per assembly): two stores that both
    assemble a delivery (replicas, a redelivery) never write into each
    other's chunks, and discarding one never touches a committed object.
    It starts with `<job>.<kind>.<attempt>.` so that a committed object of
    the same delivery is recognised.
    """
    return f"{delivery_prefix(key)}{writer}"


def delivery_prefix(key: Key) -> str:
    if key.is_checkpoint:
        return f"{key.job_id}.{key.kind.value}.{key.attempt}.{key.step}."
    return f"{key.job_id}.{key.kind.value}.{key.attempt}."


def is_committed_by(nuid: str, key: Key) -> bool:
    """Whether an object's nuid says it was committed from this delivery."""
    return nuid.startswith(delivery_prefix(key))


def is_stored(info: ObjectInfo | None, key: Key) -> TypeGuard[ObjectInfo]:
    """Whether the object store holds this delivery's object, committed and not deleted
    (by this store before a crash, or by a replica)."""
    return info is not None and not info.deleted and is_committed_by(info.nuid, key)


def report_owed(job: JobRecord | None, key: Key) -> bool:
    """Whether the recorder has yet to hear that this artifact is stored."""
    if job is None:
        return False
    if key.is_checkpoint:
        held = job.checkpoint
        return held is None or (held.attempt, held.step) != (key.attempt, key.step)
    return key.kind not in job.artifacts_stored


def stored_step(info: ObjectInfo | None) -> tuple[int, int] | None:
    """(attempt, step) of the checkpoint an object's info describes; None when
    there is none (or it does not say)."""
    if info is None or info.deleted:
        return None
    try:
        return int(info.metadata["attempt"]), int(info.metadata["step"])
    except (KeyError, ValueError):
        return None


def superseded(current: ObjectInfo | None, key: Key) -> str | None:
    """Why checkpoint `key` must not replace the stored one, or None when it may.

    Within one attempt steps only grow, so a step at or below the stored one
    is a late copy (a replica, a redelivery) and would roll the job back; a
    later attempt's checkpoint always replaces an earlier attempt's (that
    attempt resumed from it, or from an older one, and is the job now).
    """
    held = stored_step(current)
    if held is None:
        return None
    attempt, step = held
    if key.attempt < attempt or (key.attempt == attempt and key.step <= step):
        return f"{key.label} is not newer than the stored one (step {step} of attempt {attempt})"
    return None


def object_info(
    names: Names,
    key: Key,
    whole: VerifiedArtifact,
    *,
    chunks: int,
    chunk_bytes: int,
    base_model: str,
    now: dt.datetime,
    nuid: str,
) -> dict[str, Any]:
    """The object's info message, as the NATS object store (any client) reads it."""
    stamp = now.astimezone(dt.UTC).isoformat().replace("+00:00", "Z")
    metadata = {
        "sha256": whole.sha256,
        "size": str(whole.size),
        "job_id": key.job_id,
        "node": key.node,
        "kind": key.kind.value,
        "attempt": str(key.attempt),
        "base_model": base_model,
        "stored_at": stamp,
    }
    if key.is_checkpoint:
        metadata["step"] = str(key.step)
    return {
        "name": artifact_object_name(key.job_id, key.kind.value),
        "description": f"lorafleet {key.kind.value} artifact of job {key.job_id}",
        "metadata": metadata,
        "options": {"max_chunk_size": chunk_bytes},
        "bucket": names.artifacts_bucket,
        "nuid": nuid,
        "size": whole.size,
        "mtime": stamp,
        "chunks": chunks,
        "digest": object_digest(whole.sha256),
    }
