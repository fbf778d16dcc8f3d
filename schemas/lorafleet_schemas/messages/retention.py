"""Retention: what lorafleet removes that nothing needs any more (`lorafleet gc`)."""

from __future__ import annotations

import msgspec


class GcRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """`lorafleet.api.artifacts.gc` (the artifact-store: adapters, checkpoints)
    and `lorafleet.api.datasets.gc` (the recorder: training and evaluation data)."""

    #: List what would be removed, and why, without removing it.
    dry_run: bool = False


class GcItem(msgspec.Struct, kw_only=True):
    """One object, removed (or, in a dry run, removable) and why."""

    bucket: str
    #: The object's name in `bucket` (`<job>/<kind>`, `sha256/<hex>`).
    object: str
    #: "peft", "gguf", "checkpoint" or "dataset".
    kind: str
    size: int
    #: The rule that let it go, in words ("job j1 ended 15 days ago; checkpoints
    #: are kept 14 days after their job ends").
    reason: str
    #: The job it belonged to, for an artifact.
    job_id: str | None = None


class GcReport(msgspec.Struct, kw_only=True):
    dry_run: bool
    #: Removed by this run (a dry run: what it would remove).
    removed: list[GcItem] = msgspec.field(default_factory=list)
    #: The bytes those objects held.
    freed_bytes: int = 0
    #: Unneeded, but kept until the grace has passed since a sweep first found
    #: them so (Settings.retention_grace_s): a reference may be on its way.
    waiting: list[GcItem] = msgspec.field(default_factory=list)
    #: Objects looked at.
    examined: int = 0
    #: Why nothing was removed at all (set only then): the database looks fresh
    #: or wrong (no jobs; none of the stored artifacts' jobs).
    refused: str = ""
