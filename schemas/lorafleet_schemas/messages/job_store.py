"""The recorder's internal job API (`lorafleet.store.jobs.*`), used by the
scheduler and the artifact-store."""

from __future__ import annotations

import msgspec

from lorafleet_schemas.messages.artifacts import ArtifactKind
from lorafleet_schemas.messages.fields import Sha256Hex
from lorafleet_schemas.messages.jobs import JobRecord, JobState


class TransitionRequest(
    msgspec.Struct, kw_only=True, forbid_unknown_fields=True, omit_defaults=True
):
    """`lorafleet.store.jobs.transition`: compare-and-set of a job's state.

    Applied only when the job is in `from_state` (and, when `node` is given
    for a job that has one, on that node). A final state never changes.
    """

    id: str
    from_state: JobState
    to_state: JobState
    message: str = ""
    #: Set the job's node (placement of a job submitted without one).
    node: str | None = None
    #: A requeue the operator asked for (a drain's `move_training`), not a
    #: loss: applied whatever the attempts left, and the job's max_attempts
    #: grows by one, so the move uses none of the attempts it has for failures.
    moved: bool = False


class TransitionReply(msgspec.Struct, kw_only=True):
    """`applied` is false when the job had moved on; `job` is as it is now."""

    applied: bool
    job: JobRecord


class ArtifactStoredRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """`lorafleet.store.jobs.artifact`: an artifact of a job is stored and verified."""

    id: str
    kind: ArtifactKind
    size: int
    sha256: Sha256Hex
    #: For a checkpoint: the step it holds, the attempt that wrote it, its object.
    step: int | None = None
    attempt: int | None = None
    object: str | None = None
    #: Retention is about to remove this stored artifact (the artifact-store,
    #: before it removes it): the recorder forgets its reference, refusing
    #: (conflict) while the job is not final. `size` and `sha256` are unread.
    removed: bool = False
