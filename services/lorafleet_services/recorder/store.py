"""The recorder's store: plain async functions over an async sessionmaker.

Each function is one short transaction and never touches the network; the
service publishes events only after these return (after commit). Every
write to a job is guarded: transitions compare-and-set on the state, the
other writes on the row's `version`, so of two racing writers exactly one
wins on PostgreSQL and on SQLite, and the loser re-reads or reports
`applied=False`.

Status reports (`apply_status`) are applied per job so that the outcome
does not depend on delivery order or repetition:

- a report from another node or attempt than the job's is refused, and so
  is any report for a queued job (a requeued job's lost attempt);
- each loss point is inserted once (ON CONFLICT DO NOTHING on job, step,
  attempt);
- peak_mib only grows;
- each scalar field (step, steps, loss, eval_loss, message, state) takes
  the value of the highest-sequence report that carried it (`field_seqs`),
  and `last_seq` is the highest sequence applied;
- a state change must be allowed by `lorafleet.states` (a report never
  makes `done` and never changes a final state); a move to `uploading`
  when every expected artifact is already stored goes on to `done`;
- a final job takes no report newer than the last one it applied;
- a `failed` report with `retryable` (the cause is not the job's own)
  requeues a job that has attempts left (`states.loss_outcome`), else fails
  it with the report's message.

Attempts: each move to `starting` counts one and records the step it starts
from (`attempt_starts`: its own checkpoint's, else 0); `curve` returns the
effective curve, in which a later attempt's points supersede an earlier
one's from the step the later one started at.
"""

from __future__ import annotations

import datetime as dt
import uuid
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar

import msgspec
from sqlalchemy import Table, func, insert, or_, select, update
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncSession

from lorafleet.names import artifact_object_name
from lorafleet.states import (
    FINAL,
    REQUEUE_FROM,
    IllegalTransitionError,
    can_move,
    can_requeue,
    can_resume,
    check_move,
    loss_outcome,
)
from lorafleet_schemas.messages import (
    ArtifactKind,
    CheckpointRef,
    Engine,
    EvalPoint,
    JobCurve,
    JobEventRecord,
    JobRecord,
    JobSpec,
    JobState,
    LossPoint,
    ModelArchitecture,
    ModelRecord,
    ModelSpec,
    StatusReport,
    TrainerParams,
)
from lorafleet_services.recorder.db import Sessions
from lorafleet_services.recorder.models import EvalPoint as EvalPointRow
from lorafleet_services.recorder.models import Job, JobEventRow, Model
from lorafleet_services.recorder.models import LossPoint as LossPointRow

#: Times a guarded write is retried after losing a race to another writer.
GUARD_RETRIES = 8

_jobs: Table = Job.__table__  # type: ignore[assignment]
_models: Table = Model.__table__  # type: ignore[assignment]
_points: Table = LossPointRow.__table__  # type: ignore[assignment]
_events: Table = JobEventRow.__table__  # type: ignore[assignment]
_evals: Table = EvalPointRow.__table__  # type: ignore[assignment]

#: Scalar job fields a status report sets, each from its newest report.
_SCALARS = ("step", "steps", "loss", "eval_loss", "message")


class StoreError(Exception):
    """Base of the errors the store raises for a request it cannot satisfy."""


class NotFoundError(StoreError):
    """No such job or model."""


class ModelExistsError(StoreError):
    """A catalog entry of that name exists already."""


class ArtifactKindError(StoreError):
    """An artifact kind the job does not make."""


class ResumeError(StoreError):
    """A resume the job's state or stored checkpoints do not allow."""


class _GuardMissedError(Exception):
    """A guarded UPDATE matched no row: another writer changed the job first."""


def now() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


def new_job_id() -> str:
    """A job id: 16 hex digits, safe in a subject and short enough to type."""
    return uuid.uuid4().hex[:16]


# --- the boundary: rows -> wire records -------------------------------------


def model_record(row: Mapping[Any, Any]) -> ModelRecord:
    return ModelRecord(
        name=row["name"],
        engine=Engine(row["engine"]),
        hf_repo=row["hf_repo"],
        hf_revision=row["hf_revision"],
        local_dir=row["local_dir"],
        description=row["description"],
        created_at=row["created_at"],
        architecture=(
            None
            if row.get("architecture") is None
            else msgspec.convert(row["architecture"], ModelArchitecture)
        ),
    )


def job_record(row: Mapping[Any, Any]) -> JobRecord:
    """The one conversion of a jobs row to the wire's JobRecord."""
    return JobRecord(
        id=row["id"],
        name=row["name"],
        model=row["model"],
        engine=Engine(row["engine"]),
        node=row["node"],
        gpu_memory_mib=row["gpu_memory_mib"],
        dataset=row["dataset"],
        dataset_sha256=row["dataset_sha256"],
        records=row["records"],
        params=msgspec.convert(row["params"], TrainerParams),
        state=JobState(row["state"]),
        message=row["message"],
        step=row["step"],
        steps=row["steps"],
        loss=row["loss"],
        eval_loss=row["eval_loss"],
        peak_mib=row["peak_mib"],
        attempt=row["attempt"],
        artifacts_expected=[ArtifactKind(k) for k in row["artifacts_expected"]],
        artifacts_stored=[ArtifactKind(k) for k in row["artifacts_stored"]],
        created_at=row["created_at"],
        updated_at=row["updated_at"],
        started_at=row["started_at"],
        finished_at=row["finished_at"],
        max_attempts=row["max_attempts"],
        requested_node=row["requested_node"],
        resume_from=row["resume_from"],
        checkpoint=(
            None if row["checkpoint"] is None else msgspec.convert(row["checkpoint"], CheckpointRef)
        ),
        adapter=artifact_ref(row, ArtifactKind.PEFT),
        version=row["version"],
    )


def artifact_ref(row: Mapping[Any, Any], kind: ArtifactKind) -> CheckpointRef | None:
    """The stored `kind` artifact of a job row as a ref to start from, if stored."""
    stored = (row["artifact_refs"] or {}).get(kind.value)
    if stored is None:
        return None
    return CheckpointRef(job_id=row["id"], kind=kind, **stored)


def start_ref(row: Mapping[Any, Any]) -> CheckpointRef | None:
    """What a job started from another job's work (`row`) starts from: its
    newest checkpoint, else its adapter."""
    if row["checkpoint"] is not None:
        return msgspec.convert(row["checkpoint"], CheckpointRef)
    return artifact_ref(row, ArtifactKind.PEFT)


async def _load_job(s: AsyncSession, job_id: str) -> dict[str, Any] | None:
    row = (await s.execute(select(_jobs).where(_jobs.c.id == job_id))).mappings().first()
    return dict(row) if row is not None else None


async def _guarded_update(s: AsyncSession, row: dict[str, Any], values: dict[str, Any]) -> None:
    """Write `values` to the job of `row` if no one has since `row` was read
    (else _GuardMissedError), and bring `row` up to what was written."""
    version = row["version"] + 1
    result = await s.execute(
        update(_jobs)
        .where(_jobs.c.id == row["id"], _jobs.c.version == row["version"])
        .values(**values, version=version)
    )
    if result.rowcount != 1:  # type: ignore[attr-defined]
        raise _GuardMissedError(row["id"])
    row.update(values, version=version)


def _event_row(
    job_id: str, time: dt.datetime, from_state: JobState | None, to_state: JobState, message: str
) -> dict[str, Any]:
    return {
        "job_id": job_id,
        "time": time,
        "from_state": from_state.value if from_state is not None else None,
        "to_state": to_state.value,
        "message": message,
    }


# --- the catalog --------------------------------------------------------------


async def add_model(sm: Sessions, spec: ModelSpec) -> ModelRecord:
    """Add a catalog entry; ModelExistsError when the name is taken."""
    row = {
        "name": spec.name,
        "engine": spec.engine.value,
        "hf_repo": spec.hf_repo,
        "hf_revision": spec.hf_revision,
        "local_dir": spec.local_dir,
        "description": spec.description,
        "created_at": now(),
        "architecture": None
        if spec.architecture is None
        else msgspec.to_builtins(spec.architecture),
    }
    try:
        async with sm() as s, s.begin():
            await s.execute(insert(_models).values(**row))
    except IntegrityError:
        raise ModelExistsError(spec.name) from None
    return model_record(row)


async def list_models(sm: Sessions) -> list[ModelRecord]:
    async with sm() as s, s.begin():
        rows = (await s.execute(select(_models).order_by(_models.c.name))).mappings().all()
    return [model_record(r) for r in rows]


async def get_model(sm: Sessions, name: str) -> ModelRecord | None:
    async with sm() as s, s.begin():
        row = (await s.execute(select(_models).where(_models.c.name == name))).mappings().first()
    return model_record(row) if row is not None else None


# --- jobs ---------------------------------------------------------------------


async def create_job(
    sm: Sessions,
    spec: JobSpec,
    model: ModelRecord,
    dataset: str,
    dataset_sha256: str,
    records: int,
    job_id: str | None = None,
) -> JobRecord:
    """Insert a queued job for `spec` (already checked) and its first job event."""
    t = now()
    expected = [ArtifactKind.PEFT.value]
    if model.engine is Engine.LLAMACPP:
        expected.append(ArtifactKind.GGUF.value)
    row: dict[str, Any] = {
        "id": job_id or new_job_id(),
        "name": spec.name,
        "model": model.name,
        "engine": model.engine.value,
        "node": spec.node,
        "gpu_memory_mib": spec.gpu_memory_mib,
        "dataset": dataset,
        "dataset_sha256": dataset_sha256,
        "records": records,
        "params": msgspec.to_builtins(spec.params),
        "state": JobState.QUEUED.value,
        "message": "",
        "step": 0,
        "steps": 0,
        "loss": None,
        "eval_loss": None,
        "peak_mib": 0,
        "attempt": 0,
        "last_seq": 0,
        "field_seqs": {},
        "artifacts_expected": expected,
        "artifacts_stored": [],
        "version": 1,
        "created_at": t,
        "updated_at": t,
        "started_at": None,
        "finished_at": None,
        "max_attempts": spec.max_attempts,
        "requested_node": spec.node,
        "resume_from": spec.resume_from,
        "checkpoint": None,
        "artifact_refs": None,
        "attempt_starts": None,
    }
    async with sm() as s, s.begin():
        await s.execute(insert(_jobs).values(**row))
        await s.execute(
            insert(_events).values(_event_row(row["id"], t, None, JobState.QUEUED, "submitted"))
        )
    return job_record(row)


async def get_job(sm: Sessions, job_id: str) -> JobRecord | None:
    async with sm() as s, s.begin():
        row = await _load_job(s, job_id)
    return job_record(row) if row is not None else None


async def list_jobs(
    sm: Sessions,
    *,
    state: JobState | None = None,
    states: Iterable[JobState] = (),
    node: str | None = None,
    model: str | None = None,
    limit: int = 50,
    oldest_first: bool = False,
) -> list[JobRecord]:
    """Jobs matching every filter given (`state` joins `states`); newest first by default."""
    wanted = {s.value for s in states}
    if state is not None:
        wanted.add(state.value)
    q = select(_jobs)
    if wanted:
        q = q.where(_jobs.c.state.in_(sorted(wanted)))
    if node is not None:
        q = q.where(_jobs.c.node == node)
    if model is not None:
        q = q.where(_jobs.c.model == model)
    if oldest_first:
        q = q.order_by(_jobs.c.created_at.asc(), _jobs.c.id.asc())
    else:
        q = q.order_by(_jobs.c.created_at.desc(), _jobs.c.id.desc())
    async with sm() as s, s.begin():
        rows = (await s.execute(q.limit(limit))).mappings().all()
    return [job_record(r) for r in rows]


async def job_counts(sm: Sessions) -> tuple[dict[str, int], dt.datetime | None]:
    """Jobs by state, and when the oldest queued job was created (None: none queued)."""
    by_state = select(_jobs.c.state, func.count()).group_by(_jobs.c.state)
    oldest = select(func.min(_jobs.c.created_at)).where(_jobs.c.state == JobState.QUEUED.value)
    async with sm() as s, s.begin():
        counts = {state: int(n) for state, n in (await s.execute(by_state)).all()}
        created = (await s.execute(oldest)).scalar()
    if created is not None and created.tzinfo is None:
        created = created.replace(tzinfo=dt.UTC)  # SQLite keeps no zone
    return counts, created


async def transition(
    sm: Sessions,
    job_id: str,
    from_state: JobState,
    to_state: JobState,
    message: str = "",
    node: str | None = None,
) -> tuple[bool, JobRecord]:
    """Compare-and-set the job's state; return (applied, the job as it is now).

    Applied only when the job is in `from_state` and, when `node` is given
    and the job has a node, on that node. Moving to `starting` stamps
    `started_at`, counts an attempt (whose status sequence starts afresh),
    records the step it starts from and sets the node when given; a final
    state stamps `finished_at`. Raises IllegalTransitionError for a move the
    state machine forbids (and for `done`, which only storing every artifact
    reaches), NotFoundError for an unknown job.

    queued -> queued is not a move: it sets the message of a job that is
    still queued (the scheduler says what the job waits for), records no
    event, and is applied only when the message changes.

    on a node -> queued is the requeue (`lorafleet.states`): applied only
    while the job has attempts left; the job's node goes back to the one
    its submitter named.
    """
    if from_state is JobState.QUEUED and to_state is JobState.QUEUED:
        return await _set_queued_message(sm, job_id, message)
    requeue = to_state is JobState.QUEUED and from_state in REQUEUE_FROM
    if not requeue:
        check_move(from_state, to_state)
    if to_state is JobState.DONE:
        raise IllegalTransitionError(
            "a job becomes done when every artifact is stored (store.jobs.artifact), "
            "not by a transition"
        )
    t = now()
    guard, values = _move_statement(job_id, from_state, to_state, message, node, t)
    async with sm() as s, s.begin():
        if requeue:
            _check_attempts_left(await _load_job(s, job_id), from_state)
        if to_state is JobState.STARTING:
            before = await _load_job(s, job_id)
            if before is not None:
                values.update(_starting_values(before, t))
                # The attempt counted is the one read: the same row, or no move.
                guard = guard.where(_jobs.c.attempt == before["attempt"])
        result = await s.execute(guard.values(**values))
        applied = result.rowcount == 1  # type: ignore[attr-defined]
        if applied:
            await s.execute(
                insert(_events).values(_event_row(job_id, t, from_state, to_state, message))
            )
        row = await _load_job(s, job_id)
    if row is None:
        raise NotFoundError(job_id)
    return applied, job_record(row)


def _move_statement(
    job_id: str,
    from_state: JobState,
    to_state: JobState,
    message: str,
    node: str | None,
    t: dt.datetime,
) -> tuple[Any, dict[str, Any]]:
    """The guarded UPDATE of a transition (see `transition`) and its values."""
    requeue = to_state is JobState.QUEUED and from_state in REQUEUE_FROM
    values: dict[str, Any] = {
        "state": to_state.value,
        "message": message,
        "updated_at": t,
        "version": _jobs.c.version + 1,
    }
    if node is not None:
        values["node"] = node
    if requeue:
        values["node"] = _jobs.c.requested_node
    if to_state in FINAL:
        values["finished_at"] = t
    guard = update(_jobs).where(_jobs.c.id == job_id, _jobs.c.state == from_state.value)
    if node is not None:
        guard = guard.where(or_(_jobs.c.node.is_(None), _jobs.c.node == node))
    if requeue:
        guard = guard.where(_jobs.c.attempt < _jobs.c.max_attempts)
    return guard, values


def _check_attempts_left(row: Mapping[str, Any] | None, from_state: JobState) -> None:
    """A requeue of a job with no attempts left is a move the machine forbids
    (a job no longer in `from_state` is left to the compare-and-set: not applied)."""
    if row is None or row["state"] != from_state.value:
        return
    if not can_requeue(from_state, row["attempt"], row["max_attempts"]):
        raise IllegalTransitionError(
            f"a job cannot go from {from_state.value} back to queued without attempts "
            f"left: it is on attempt {row['attempt']} of {row['max_attempts']}"
        )


def _starting_values(row: Mapping[str, Any], t: dt.datetime) -> dict[str, Any]:
    """The columns a move to `starting` sets: the next attempt and the step it
    starts from (its own checkpoint's: the scheduler resumes from it)."""
    attempt = row["attempt"] + 1
    start = row["checkpoint"]["step"] if row["checkpoint"] is not None else 0
    starts = {**(row["attempt_starts"] or {}), str(attempt): start}
    return {
        "started_at": t,
        "attempt": attempt,
        "last_seq": 0,
        "field_seqs": {},
        "attempt_starts": starts,
    }


async def _set_queued_message(sm: Sessions, job_id: str, message: str) -> tuple[bool, JobRecord]:
    guard = update(_jobs).where(
        _jobs.c.id == job_id,
        _jobs.c.state == JobState.QUEUED.value,
        _jobs.c.message != message,
    )
    async with sm() as s, s.begin():
        result = await s.execute(
            guard.values(message=message, updated_at=now(), version=_jobs.c.version + 1)
        )
        applied = result.rowcount == 1  # type: ignore[attr-defined]
        row = await _load_job(s, job_id)
    if row is None:
        raise NotFoundError(job_id)
    return applied, job_record(row)


# --- status reports -------------------------------------------------------------


@dataclass
class Move:
    """A state change made by a report (or by artifacts completing)."""

    from_state: JobState
    to_state: JobState
    message: str


@dataclass
class Folded:
    """What a batch of reports does to one job (pure result of `fold`)."""

    values: dict[str, Any] = field(default_factory=dict)
    points: list[dict[str, Any]] = field(default_factory=list)
    evals: list[dict[str, Any]] = field(default_factory=list)
    moves: list[Move] = field(default_factory=list)
    refused: list[tuple[StatusReport, str]] = field(default_factory=list)
    #: Reports whose state change was older than the job's state (dropped).
    stale: list[StatusReport] = field(default_factory=list)


def _all_stored(expected: Sequence[str], stored: Sequence[str]) -> bool:
    return set(expected) <= set(stored)


def refusal(job: Mapping[str, Any], report: StatusReport) -> str | None:
    """Why `report` does not apply to `job` at all, or None when it applies."""
    if job["node"] is None:
        return f"job {job['id']} is not placed on any node; node {report.node} cannot report it"
    if report.node != job["node"]:
        return f"job {job['id']} runs on node {job['node']}, not {report.node}"
    if job["state"] == JobState.QUEUED.value:
        return (
            f"job {job['id']} is queued again (attempt {job['attempt']} ended); "
            f"node {report.node} cannot report it"
        )
    if report.attempt != job["attempt"]:
        return f"job {job['id']} is on attempt {job['attempt']}, the report is of {report.attempt}"
    if JobState(job["state"]) in FINAL and report.seq > job["last_seq"]:
        return f"job {job['id']} is {job['state']}, which is final"
    return None


def fold(job: Mapping[str, Any], reports: Iterable[StatusReport], t: dt.datetime) -> Folded:
    """Apply `reports` to a job row in memory: the new column values and what else to write."""
    out = Folded()
    state = JobState(job["state"])
    last_seq: int = job["last_seq"]
    seqs: dict[str, int] = dict(job["field_seqs"])
    scalars: dict[str, Any] = {f: job[f] for f in _SCALARS}
    peak: int = job["peak_mib"]
    for r in sorted(reports, key=lambda r: r.seq):
        why = refusal({**job, "state": state.value, "last_seq": last_seq}, r)
        if why is not None:
            out.refused.append((r, why))
            continue
        if r.peak_mib is not None:
            peak = max(peak, r.peak_mib)
        if r.step is not None and r.loss is not None:
            out.points.append(_loss_point(job["id"], r))
        if r.step is not None and r.eval_loss is not None:
            out.evals.append(
                {
                    "job_id": job["id"],
                    "step": r.step,
                    "eval_loss": r.eval_loss,
                    "attempt": r.attempt,
                }
            )
        _take_scalars(r, scalars, seqs)
        if r.state is not None and r.seq > seqs.get("state", 0):
            if r.state is JobState.FAILED and r.retryable and state in REQUEUE_FROM:
                move = _retryable_failure(job, scalars, state, r)
                out.moves.append(move)
                state = move.to_state
                seqs["state"] = r.seq
                scalars["message"] = move.message
                if state is JobState.QUEUED:
                    # The attempt is over: its later reports are refused (queued).
                    out.values["node"] = job["requested_node"]
            elif r.state is not state and can_move(state, r.state) and r.state is not JobState.DONE:
                out.moves.append(Move(state, r.state, r.message))
                state = r.state
                seqs["state"] = r.seq
                if state is JobState.UPLOADING and _all_stored(
                    job["artifacts_expected"], job["artifacts_stored"]
                ):
                    said = _stored_message(job["artifacts_stored"])
                    out.moves.append(Move(state, JobState.DONE, said))
                    state = JobState.DONE
                    scalars["message"] = said
            elif r.state is JobState.DONE:
                out.refused.append((r, "a status report cannot make a job done"))
            elif r.state is not state:
                out.stale.append(r)
        last_seq = max(last_seq, r.seq)
    new = {**scalars, "state": state.value, "last_seq": last_seq, "field_seqs": seqs}
    out.values = {**out.values, **_changed(job, {**new, "peak_mib": peak}, t)}
    return out


def _retryable_failure(
    job: Mapping[str, Any], scalars: Mapping[str, Any], state: JobState, r: StatusReport
) -> Move:
    """A failure not the job's own: requeued with attempts left, else failed."""
    now_job = job_record({**job, **scalars, "state": state.value})
    cause = f"the job failed on node {r.node} for a cause not its own ({r.message})"
    to, said = loss_outcome(now_job, cause, r.message)
    return Move(state, to, said)


def _loss_point(job_id: str, r: StatusReport) -> dict[str, Any]:
    """The loss_points row of a report that carries a step and its loss."""
    return {
        "job_id": job_id,
        "step": r.step,
        "loss": r.loss,
        "learning_rate": r.learning_rate,
        "tokens_per_s": r.tokens_per_s,
        "peak_mib": r.peak_mib,
        "attempt": r.attempt,
    }


def _take_scalars(r: StatusReport, scalars: dict[str, Any], seqs: dict[str, int]) -> None:
    """Each scalar `r` carries, if `r` is newer than the report that set it (`field_seqs`)."""
    for name in _SCALARS:
        value = getattr(r, name)
        if value is None or (name == "message" and not value):
            continue
        if r.seq > seqs.get(name, 0):
            scalars[name] = value
            seqs[name] = r.seq


def _changed(job: Mapping[str, Any], new: dict[str, Any], t: dt.datetime) -> dict[str, Any]:
    """The columns of `new` that differ from `job`'s, stamped with `t` when any do."""
    values = {k: v for k, v in new.items() if job[k] != v}
    if values:
        values["updated_at"] = t
        if JobState(new["state"]) in FINAL and JobState(job["state"]) not in FINAL:
            values["finished_at"] = t
    return values


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
    """Apply a batch of status reports in one transaction (see the module docstring).

    The result lists each changed job as committed, for publishing after commit.
    """
    by_job: dict[str, list[StatusReport]] = {}
    for r in reports:
        by_job.setdefault(r.job_id, []).append(r)
    for _ in range(GUARD_RETRIES):
        try:
            return await _apply_status_once(sm, by_job)
        except _GuardMissedError:
            continue
    return await _apply_status_once(sm, by_job)  # the last try: a miss now propagates


async def _apply_status_once(sm: Sessions, by_job: dict[str, list[StatusReport]]) -> StatusResult:
    result = StatusResult()
    t = now()
    async with sm() as s, s.begin():
        rows = {
            r["id"]: dict(r)
            for r in (
                await s.execute(select(_jobs).where(_jobs.c.id.in_(sorted(by_job))))
            ).mappings()
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
                _event_row(job_id, t, m.from_state, m.to_state, m.message) for m in folded.moves
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
            await s.execute(_insert_ignore(s, _points), points)
        if evals:
            await s.execute(_insert_ignore(s, _evals), evals)
        if events:
            await s.execute(insert(_events), events)
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

        def once() -> Any:
            return _record_checkpoint_once(sm, job_id, cp)
    else:
        ref: dict[str, Any] = {
            "object": object_name or artifact_object_name(job_id, kind.value),
            "size": size,
            "sha256": sha256,
        }

        def once() -> Any:
            return _record_artifact_once(sm, job_id, kind, ref)

    for _ in range(GUARD_RETRIES):
        try:
            return await once()  # type: ignore[no-any-return]
        except _GuardMissedError:
            continue
    return await once()  # type: ignore[no-any-return]  # the last try: a miss now propagates


def _checkpoint_ref(
    job_id: str,
    size: int,
    sha256: str,
    step: int | None,
    attempt: int | None,
    object_name: str | None,
) -> CheckpointRef:
    if step is None or attempt is None or object_name is None:
        raise CheckpointFieldsError(
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


class CheckpointFieldsError(StoreError):
    """A checkpoint reported without its step, attempt or object."""


def _stored_message(stored: list[str]) -> str:
    return f"every artifact is stored and verified: {', '.join(stored)}"


async def _record_checkpoint_once(
    sm: Sessions, job_id: str, ref: CheckpointRef
) -> tuple[JobRecord, JobChange | None]:
    async with sm() as s, s.begin():
        row = await _load_job(s, job_id)
        if row is None:
            raise NotFoundError(job_id)
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
        row = await _load_job(s, job_id)
        if row is None:
            raise NotFoundError(job_id)
        if kind.value not in row["artifacts_expected"]:
            raise ArtifactKindError(
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
        if state is JobState.UPLOADING and _all_stored(row["artifacts_expected"], stored):
            said = _stored_message(stored)
            moves.append(Move(state, JobState.DONE, said))
            values.update(state=JobState.DONE.value, finished_at=t, message=said)
        await _guarded_update(s, row, values)
        if moves:
            await s.execute(
                insert(_events),
                [_event_row(job_id, t, m.from_state, m.to_state, m.message) for m in moves],
            )
    job = job_record(row)
    return job, JobChange(job, "state" if moves else "progress", moves)


# --- the curve ------------------------------------------------------------------


async def curve(sm: Sessions, job_id: str) -> JobCurve:
    """The job's effective loss and eval curves (by step; see `effective`) and
    its state changes (in order)."""
    async with sm() as s, s.begin():
        job = await _load_job(s, job_id)
        if job is None:
            raise NotFoundError(job_id)
        starts = {int(a): step for a, step in (job["attempt_starts"] or {}).items()}
        points = (
            await s.execute(
                select(_points)
                .where(_points.c.job_id == job_id)
                .order_by(_points.c.step, _points.c.attempt)
            )
        ).mappings()
        point_list = [
            LossPoint(
                step=p["step"],
                loss=p["loss"],
                learning_rate=p["learning_rate"],
                tokens_per_s=p["tokens_per_s"],
                peak_mib=p["peak_mib"],
                attempt=p["attempt"],
            )
            for p in points
        ]
        events = (
            await s.execute(
                select(_events).where(_events.c.job_id == job_id).order_by(_events.c.id)
            )
        ).mappings()
        event_list = [
            JobEventRecord(
                time=e["time"],
                from_state=JobState(e["from_state"]) if e["from_state"] else None,
                to_state=JobState(e["to_state"]),
                message=e["message"],
            )
            for e in events
        ]
        evals = await _eval_points(s, job_id)
    return JobCurve(
        id=job_id,
        points=effective(point_list, starts),
        events=event_list,
        evals=effective(evals, starts),
    )


P = TypeVar("P", LossPoint, EvalPoint)


def effective(points: Sequence[P], starts: Mapping[int, int]) -> list[P]:
    """The points a curve shows, by step: a point of attempt a is superseded
    when a later attempt b started at or before it (its step > b's start
    step, the checkpoint b resumed from). starts: attempt -> start step; an
    attempt missing from it (none recorded) starts before its first point."""
    first: dict[int, int] = {}
    for p in points:
        first[p.attempt] = min(first.get(p.attempt, p.step), p.step)
    begun = {a: starts.get(a, first.get(a, 1) - 1) for a in {*starts, *first}}
    kept = [
        p for p in points if not any(b > p.attempt and p.step > start for b, start in begun.items())
    ]
    return sorted(kept, key=lambda p: (p.step, p.attempt))


async def _eval_points(s: AsyncSession, job_id: str) -> list[EvalPoint]:
    rows = await s.execute(
        select(_evals.c.step, _evals.c.eval_loss, _evals.c.attempt)
        .where(_evals.c.job_id == job_id)
        .order_by(_evals.c.step, _evals.c.attempt)
    )
    return [EvalPoint(step=step, eval_loss=loss, attempt=attempt) for step, loss, attempt in rows]


# --- resume ---------------------------------------------------------------------


async def resume_source(sm: Sessions, job_id: str) -> tuple[JobRecord, CheckpointRef | None] | None:
    """The job a new job resumes from (JobSpec.resume_from) and what it would
    start from (its newest checkpoint, else its adapter); None: no such job."""
    async with sm() as s, s.begin():
        row = await _load_job(s, job_id)
    if row is None:
        return None
    return job_record(row), start_ref(row)


async def resume_job(
    sm: Sessions, job_id: str, attempts: int, reason: str = ""
) -> tuple[JobRecord, Move]:
    """Queue a failed or cancelled job again from its newest checkpoint, with
    `attempts` more attempts (api.jobs.resume). NotFoundError for an unknown
    job, ResumeError (saying why, nothing changed) for one not failed or
    cancelled or with no checkpoint."""
    for _ in range(GUARD_RETRIES):
        try:
            return await _resume_once(sm, job_id, attempts, reason)
        except _GuardMissedError:
            continue
    return await _resume_once(sm, job_id, attempts, reason)  # a miss now propagates


async def _resume_once(
    sm: Sessions, job_id: str, attempts: int, reason: str
) -> tuple[JobRecord, Move]:
    t = now()
    async with sm() as s, s.begin():
        row = await _load_job(s, job_id)
        if row is None:
            raise NotFoundError(job_id)
        state = JobState(row["state"])
        if not can_resume(state):
            raise ResumeError(
                f"job {job_id} is {state.value}: only a failed or cancelled job can be "
                "resumed" + ("" if state in FINAL else " (cancel it first to stop it)")
            )
        if row["checkpoint"] is None:
            raise ResumeError(
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
        await s.execute(insert(_events).values(_event_row(job_id, t, state, JobState.QUEUED, said)))
    return job_record(row), Move(state, JobState.QUEUED, said)
