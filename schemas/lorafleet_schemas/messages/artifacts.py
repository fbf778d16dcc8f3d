"""What a job makes, and how it travels: the agent's chunks to the
artifact-store, and the stored artifacts' records."""

from __future__ import annotations

import datetime as dt
import enum
from typing import Annotated

import msgspec
from msgspec import Meta

from lorafleet_schemas.messages.fields import Sha256Hex


class ArtifactKind(enum.StrEnum):
    """What a job makes: the PEFT adapter directory as tar.gz, and a GGUF file;
    and, while it trains, its newest checkpoint (a tar of the checkpoint
    directory: adapter, optimizer, scheduler and RNG states, data position),
    each superseding the one before."""

    PEFT = "peft"
    GGUF = "gguf"
    CHECKPOINT = "checkpoint"


class ArtifactChunkHeader(msgspec.Struct, kw_only=True):
    """JSON in the `Lorafleet-Chunk` header of each chunk on
    `lorafleet.artifacts.<node>.<job>.<kind>`; the body is the chunk's bytes.

    The last chunk also carries the artifact's chunk count, size and sha256.
    """

    job_id: str
    node: str
    kind: ArtifactKind
    attempt: int
    seq: Annotated[int, Meta(ge=0)]
    last: bool = False
    count: int | None = None
    size: int | None = None
    sha256: Sha256Hex | None = None
    #: For a checkpoint: the optimizer step it holds.
    step: int | None = None


class ArtifactRecord(msgspec.Struct, kw_only=True):
    job_id: str
    kind: ArtifactKind
    node: str
    #: The object in `lorafleet_artifacts`: `<job>/<kind>`.
    object: str
    size: int
    sha256: str
    base_model: str
    stored_at: dt.datetime


class ArtifactListRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    job_id: str


class ArtifactList(msgspec.Struct, kw_only=True):
    artifacts: list[ArtifactRecord]


class ArtifactGetRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    job_id: str
    kind: ArtifactKind
