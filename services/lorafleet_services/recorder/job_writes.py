"""The writes to a job guarded by its version: status batches, stored artifacts, resume.

Each is load -> compute -> write in one short transaction: read the row,
decide in memory (a status batch by `fold.fold`, pure), then
`UPDATE jobs ... WHERE id = ? AND version = ?`. A write that matches no row
lost to another writer: its transaction is rolled back and the whole read,
decision and write redone from a fresh read by `until_unraced`, the one
retry loop (at most GUARD_RETRIES times, then the miss propagates). No
network call happens inside; the caller publishes the changes after commit.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Literal, TypeVar

import msgspec
from sqlalchemy import Table, insert, select, update
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.ext.asyncio import AsyncSession

from lorafleet.names import artifact_object_name
from lorafleet.states import FINAL, can_resume
from lorafleet_schemas.messages import (
    ArtifactKind,
    CheckpointRef,
    JobRecord,
    JobState,
    StatusReport,
)
from lorafleet_services.recorder import store
from lorafleet_services.recorder.db import Sessions
from lorafleet_services.recorder.fold import Move, completion, fold
from lorafleet_services.recorder.rows import artifact_ref, event_row, job_record, plain
from lorafleet_services.recorder.store import now
from lorafleet_services.recorder.tables import eval_points, job_events, jobs, loss_points

#: Times a guarded write is redone after losing a race to another writer.
GUARD_RETRIES = 8

T = TypeVar("T")


class GuardMissedError(Exception):
    """A guarded UPDATE matched no row: another writer changed the job first."""


async def until_unraced(once: Callable[[], Awaitable[T]]) -> T:
    """`once()` (one transaction that raises GuardMissedError when it lost a
    race), redone until it wins; after GUARD_RETRIES misses the next one propagates."""
    for _ in range(GUARD_RETRIES):
        try:
            return await once()
        except GuardMissedError:
            continue
    return await once()


async def _guarded_update(s: AsyncSession, row: dict[str, Any], values: dict[str, Any]) -> None:
    """Write `values` to the job of `row` if no one has since `row` was read
    (else GuardMissedError), and bring `row` up to what was written."""
    version = row["version"] + 1
    result = await s.execute(
        update(jobs)
        .where(jobs.c.id == row["id"], jobs.c.version == row["version"])
        .values(**values, version=version)
    )
    if result.rowcount != 1:  # type: ignore[attr-defined]
        raise GuardMissedError(row["id"])
    row.update(values, version=version)


# --- status reports -------------------------------------------------------------


@dataclass
class JobChange:
    """A job a batch changed: `kind` "state" when its state moved."""

    job: JobRecord
    kind: Literal["state", "progress"]
    moves: list[Move]
    #: The latest throughput and time-to-go among the batch's reports (for the event).
    tokens_per_s: float | None = None
    eta_s: float | None = None


@dataclass
class StatusResult:
    changes: list[JobChange] = field(default_factory=list)
    refused: list[tuple[StatusReport, str]] = field(default_factory=list)
    stale: list[StatusReport] = field(default_factory=list)
    #: Reports applied (not refused), counting repeats.
    applied: int = 0


def _latest_rates(reports: Sequence[StatusReport]) -> StatusReport | None:
    """The newest report (by seq) that carries tokens/s, if any."""
    rated = [r for r in reports if r.tokens_per_s is not None]
    return max(rated, key=lambda r: r.seq) if rated else None


def _insert_ignore(s: AsyncSession, table: Table) -> Any:
    key = ["job_id", "step", "attempt"]
    if s.get_bind().dialect.name == "postgresql":
        return postgresql.insert(table).on_conflict_do_nothing(index_elements=key)
    return sqlite.insert(table).on_conflict_do_nothing(index_elements=key)


async def apply_status(sm: Sessions, reports: Sequence[StatusReport]) -> StatusResult:
    """Apply a batch of status reports in one transaction (the rule: fold.py).

    The result lists each changed job as committed, for publishing after commit.
    """
    by_job: dict[str, list[StatusReport]] = {}
    for r in reports:
        by_job.setdefault(r.job_id, []).append(r)
    return await until_unraced(partial(_apply_status_once, sm, by_job))


async def _apply_status_once(sm: Sessions, by_job: dict[str, list[StatusReport]]) -> StatusResult:
    result = StatusResult()
    t = now()
    async with sm() as s, s.begin():
        rows = {
            r["id"]: plain(r)
            for r in (await s.execute(select(jobs).where(jobs.c.id.in_(sorted(by_job))))).mappings()
        }
        points: list[dict[str, Any]] = []
        evals: list[dict[str, Any]] = []
        events: list[dict[str, Any]] = []
        for job_id in sorted(by_job):
            job_reports = by_job[job_id]
            row = rows.get(job_id)
            if row is None:
                result.refused.extend((r, f"no job {job_id}") for r in job_reports)
                continue
            folded = fold(row, job_reports, t)
            result.refused.extend(folded.refused)
            result.stale.extend(folded.stale)
            result.applied += len(job_reports) - len(folded.refused)
            points.extend(folded.points)
            evals.extend(folded.evals)
            events.extend(
                event_row(job_id, t, m.from_state, m.to_state, m.message) for m in folded.moves
            )
            if folded.values:
                await _guarded_update(s, row, folded.values)
                latest = _latest_rates(job_reports)
                result.changes.append(
                    JobChange(
                        job_record(row),
                        "state" if folded.moves else "progress",
                        folded.moves,
                        latest.tokens_per_s if latest else None,
                        latest.eta_s if latest else None,
                    )
                )
        if points:
            await s.execute(_insert_ignore(s, loss_points), points)
        if evals:
            await s.execute(_insert_ignore(s, eval_points), evals)
        if events:
            await s.execute(insert(job_events), events)
    return result


# --- artifacts ------------------------------------------------------------------


async def record_artifact(
    sm: Sessions,
    job_id: str,
    kind: ArtifactKind,
    size: int,
    sha256: str,
    *,
    step: int | None = None,
    attempt: int | None = None,
    object_name: str | None = None,
) -> tuple[JobRecord, JobChange | None]:
    """Note that `kind` of the job is stored and verified (idempotent).

    When every expected artifact is stored and the job is uploading, it is
    done. A final job does not change. Returns the job and the change made,
    if any. `size` (bytes), `sha256` and the object are kept so that a later
    job can start from the artifact.

    A checkpoint (`step`, `attempt` and `object_name` required) only
    becomes the job's `checkpoint` when it is of the job's current attempt
    or a later one and newer than the one held (by attempt, then step); it
    never gates `done`, and a final job keeps taking it (a resume uses it).
    """
    if kind is ArtifactKind.CHECKPOINT:
        cp = _checkpoint_ref(job_id, size, sha256, step, attempt, object_name)
        return await until_unraced(partial(_record_checkpoint_once, sm, job_id, cp))
    ref: dict[str, Any] = {
        "object": object_name or artifact_object_name(job_id, kind.value),
        "size": size,
        "sha256": sha256,
    }
    return await until_unraced(partial(_record_artifact_once, sm, job_id, kind, ref))


def _checkpoint_ref(
    job_id: str,
    size: int,
    sha256: str,
    step: int | None,
    attempt: int | None,
    object_name: str | None,
) -> CheckpointRef:
    if step is None or attempt is None or object_name is None:
        raise store.CheckpointFieldsError(
            "a checkpoint names its step, attempt and object; give all three"
        )
    return CheckpointRef(
        job_id=job_id,
        kind=ArtifactKind.CHECKPOINT,
        step=step,
        attempt=attempt,
        object=object_name,
        size=size,
        sha256=sha256,
    )


async def _record_checkpoint_once(
    sm: Sessions, job_id: str, ref: CheckpointRef
) -> tuple[JobRecord, JobChange | None]:
    async with sm() as s, s.begin():
        row = await store.load_job(s, job_id)
        if row is None:
            raise store.NoSuchJobError(job_id)
        held = row["checkpoint"]
        newer = held is None or (ref.attempt, ref.step) > (held["attempt"], held["step"])
        if ref.attempt < row["attempt"] or not newer:
            return job_record(row), None
        values = {"checkpoint": msgspec.to_builtins(ref), "updated_at": now()}
        await _guarded_update(s, row, values)
    job = job_record(row)
    return job, JobChange(job, "progress", [])


async def _record_artifact_once(
    sm: Sessions, job_id: str, kind: ArtifactKind, ref: dict[str, Any]
) -> tuple[JobRecord, JobChange | None]:
    t = now()
    async with sm() as s, s.begin():
        row = await store.load_job(s, job_id)
        if row is None:
            raise store.NoSuchJobError(job_id)
        if kind.value not in row["artifacts_expected"]:
            raise store.ArtifactKindError(
                f"job {job_id} makes {', '.join(row['artifacts_expected'])}, not {kind.value}"
            )
        state = JobState(row["state"])
        if state in FINAL or kind.value in row["artifacts_stored"]:
            return job_record(row), None
        stored = [*row["artifacts_stored"], kind.value]
        refs = {**(row["artifact_refs"] or {}), kind.value: ref}
        values: dict[str, Any] = {
            "artifacts_stored": stored,
            "artifact_refs": refs,
            "updated_at": t,
        }
        moves: list[Move] = []
        done = completion(state, row["artifacts_expected"], stored)
        if done is not None:
            moves.append(done)
            values.update(state=done.to_state.value, finished_at=t, message=done.message)
        await _guarded_update(s, row, values)
        if moves:
            await s.execute(
                insert(job_events),
                [event_row(job_id, t, m.from_state, m.to_state, m.message) for m in moves],
            )
    job = job_record(row)
    return job, JobChange(job, "state" if moves else "progress", moves)


async def forget_artifact(
    sm: Sessions, job_id: str, kind: ArtifactKind
) -> tuple[JobRecord, JobChange | None]:
    """Retention removes the job's stored `kind`: its reference goes (a
    resume then says there is no checkpoint, a `resume_from` names what is
    left). Only of a final job: `store.ArtifactNeededError` otherwise, checked
    in the same transaction, so a job resumed since retention judged it keeps
    its checkpoint. Idempotent."""
    return await until_unraced(partial(_forget_artifact_once, sm, job_id, kind))


async def _forget_artifact_once(
    sm: Sessions, job_id: str, kind: ArtifactKind
) -> tuple[JobRecord, JobChange | None]:
    async with sm() as s, s.begin():
        row = await store.load_job(s, job_id)
        if row is None:
            raise store.NoSuchJobError(job_id)
        state = JobState(row["state"])
        if state not in FINAL:
            raise store.ArtifactNeededError(
                f"job {job_id} is {state.value}: its {kind.value} is needed, not removed"
            )
        if kind is ArtifactKind.CHECKPOINT:
            if row["checkpoint"] is None:
                return job_record(row), None
            values: dict[str, Any] = {"checkpoint": None}
        else:
            refs = dict(row["artifact_refs"] or {})
            if refs.pop(kind.value, None) is None:
                return job_record(row), None
            values = {"artifact_refs": refs}
        await _guarded_update(s, row, {**values, "updated_at": now()})
    job = job_record(row)
    return job, JobChange(job, "progress", [])


# --- resume ---------------------------------------------------------------------


async def resume_job(
    sm: Sessions, job_id: str, attempts: int, reason: str = ""
) -> tuple[JobRecord, Move]:
    """Queue a failed or cancelled job again from its newest checkpoint, with
    `attempts` more attempts (api.jobs.resume). NoSuchJobError for an unknown
    job, NotResumableError (saying why, nothing changed) for one not failed or
    cancelled or with no checkpoint (both of store.py)."""
    return await until_unraced(partial(_resume_once, sm, job_id, attempts, reason))


async def _resume_once(
    sm: Sessions, job_id: str, attempts: int, reason: str
) -> tuple[JobRecord, Move]:
    t = now()
    async with sm() as s, s.begin():
        row = await store.load_job(s, job_id)
        if row is None:
            raise store.NoSuchJobError(job_id)
        state = JobState(row["state"])
        if not can_resume(state):
            raise store.NotResumableError(
                f"job {job_id} is {state.value}: only a failed or cancelled job can be "
                "resumed" + ("" if state in FINAL else " (cancel it first to stop it)")
            )
        if row["checkpoint"] is None:
            raise store.NotResumableError(
                f"job {job_id} has no checkpoint stored, so there is nothing to resume from; "
                + (
                    f"to train on from its adapter, submit a new job with resume_from {job_id}"
                    if artifact_ref(row, ArtifactKind.PEFT) is not None
                    else "submit it again"
                )
            )
        step = row["checkpoint"]["step"]
        said = (
            f"resumed by hand{': ' + reason if reason else ''}; attempt {row['attempt'] + 1} "
            f"of {row['attempt'] + attempts} resumes from the checkpoint at step {step}"
        )
        values = {
            "state": JobState.QUEUED.value,
            "message": said,
            "node": row["requested_node"],
            "max_attempts": row["attempt"] + attempts,
            "finished_at": None,
            "updated_at": t,
        }
        await _guarded_update(s, row, values)
        await s.execute(
            insert(job_events).values(event_row(job_id, t, state, JobState.QUEUED, said))
        )
    return job_record(row), Move(state, JobState.QUEUED, said)
