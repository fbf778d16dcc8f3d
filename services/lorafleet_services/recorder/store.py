"""The recorder's store: plain async functions over an async sessionmaker.

Each function is one short transaction and never touches the network; the
service publishes events only after these return (after commit). Every
write to a job is guarded: transitions compare-and-set on the state, the
other writes on the row's `version`, so of two racing writers exactly one
wins on PostgreSQL and on SQLite, and the loser re-reads or reports
`applied=False`.

Status reports (`apply_status`) are applied per job so that the outcome
does not depend on delivery order or repetition:

- a report from another node or attempt than the job's is refused;
- each loss point is inserted once (ON CONFLICT DO NOTHING on job, step);
- peak_mib only grows;
- each scalar field (step, steps, loss, eval_loss, message, state) takes
  the value of the highest-sequence report that carried it (`field_seqs`),
  and `last_seq` is the highest sequence applied;
- a state change must be allowed by `lorafleet.states` (a report never
  makes `done` and never changes a final state); a move to `uploading`
  when every expected artifact is already stored goes on to `done`;
- a final job takes no report newer than the last one it applied.
"""

from __future__ import annotations

import datetime as dt
import uuid
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import msgspec
from sqlalchemy import Table, func, insert, or_, select, update
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncSession

from lorafleet.states import FINAL, IllegalTransitionError, can_move, check_move
from lorafleet_schemas.messages import (
    ArtifactKind,
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
    )


async def _load_job(s: AsyncSession, job_id: str) -> dict[str, Any] | None:
    row = (await s.execute(select(_jobs).where(_jobs.c.id == job_id))).mappings().first()
    return dict(row) if row is not None else None


async def _guarded_update(s: AsyncSession, row: Mapping[str, Any], values: dict[str, Any]) -> None:
    result = await s.execute(
        update(_jobs)
        .where(_jobs.c.id == row["id"], _jobs.c.version == row["version"])
        .values(**values, version=row["version"] + 1)
    )
    if result.rowcount != 1:  # type: ignore[attr-defined]
        raise _GuardMissedError(row["id"])


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
    `started_at`, counts an attempt (whose status sequence starts afresh)
    and sets the node when given; a final state stamps `finished_at`.
    Raises IllegalTransitionError for a move the state machine forbids (and
    for `done`, which only storing every artifact reaches), NotFoundError
    for an unknown job.

    queued -> queued is not a move: it sets the message of a job that is
    still queued (the scheduler says what the job waits for), records no
    event, and is applied only when the message changes.
    """
    if from_state is JobState.QUEUED and to_state is JobState.QUEUED:
        return await _set_queued_message(sm, job_id, message)
    check_move(from_state, to_state)
    if to_state is JobState.DONE:
        raise IllegalTransitionError(
            "a job becomes done when every artifact is stored (store.jobs.artifact), "
            "not by a transition"
        )
    t = now()
    values: dict[str, Any] = {
        "state": to_state.value,
        "message": message,
        "updated_at": t,
        "version": _jobs.c.version + 1,
    }
    if to_state is JobState.STARTING:
        values.update(started_at=t, attempt=_jobs.c.attempt + 1, last_seq=0, field_seqs={})
    if node is not None:
        values["node"] = node
    if to_state in FINAL:
        values["finished_at"] = t
    guard = update(_jobs).where(_jobs.c.id == job_id, _jobs.c.state == from_state.value)
    if node is not None:
        guard = guard.where(or_(_jobs.c.node.is_(None), _jobs.c.node == node))
    async with sm() as s, s.begin():
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
            out.evals.append({"job_id": job["id"], "step": r.step, "eval_loss": r.eval_loss})
        _take_scalars(r, scalars, seqs)
        if r.state is not None and r.seq > seqs.get("state", 0):
            if r.state is not state and can_move(state, r.state) and r.state is not JobState.DONE:
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
    out.values = _changed(job, {**new, "peak_mib": peak}, t)
    return out


def _loss_point(job_id: str, r: StatusReport) -> dict[str, Any]:
    """The loss_points row of a report that carries a step and its loss."""
    return {
        "job_id": job_id,
        "step": r.step,
        "loss": r.loss,
        "learning_rate": r.learning_rate,
        "tokens_per_s": r.tokens_per_s,
        "peak_mib": r.peak_mib,
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
    if s.get_bind().dialect.name == "postgresql":
        return postgresql.insert(table).on_conflict_do_nothing(index_elements=["job_id", "step"])
    return sqlite.insert(table).on_conflict_do_nothing(index_elements=["job_id", "step"])


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
                row.update(folded.values)
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
    sm: Sessions, job_id: str, kind: ArtifactKind, size: int, sha256: str
) -> tuple[JobRecord, JobChange | None]:
    """Note that `kind` of the job is stored and verified (idempotent).

    When every expected artifact is stored and the job is uploading, it is
    done. A final job does not change. Returns the job and the change made,
    if any. `size` (bytes) and `sha256` are the artifact-store's; the
    artifact-store keeps them, the recorder keeps which kinds are stored.
    """
    for _ in range(GUARD_RETRIES):
        try:
            return await _record_artifact_once(sm, job_id, kind)
        except _GuardMissedError:
            continue
    return await _record_artifact_once(sm, job_id, kind)  # the last try: a miss now propagates


def _stored_message(stored: list[str]) -> str:
    return f"every artifact is stored and verified: {', '.join(stored)}"


async def _record_artifact_once(
    sm: Sessions, job_id: str, kind: ArtifactKind
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
        values: dict[str, Any] = {"artifacts_stored": stored, "updated_at": t}
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
        row.update(values)
    job = job_record(row)
    return job, JobChange(job, "state" if moves else "progress", moves)


# --- the curve ------------------------------------------------------------------


async def curve(sm: Sessions, job_id: str) -> JobCurve:
    """The job's loss points (by step) and state changes (in order)."""
    async with sm() as s, s.begin():
        if await _load_job(s, job_id) is None:
            raise NotFoundError(job_id)
        points = (
            await s.execute(
                select(_points).where(_points.c.job_id == job_id).order_by(_points.c.step)
            )
        ).mappings()
        point_list = [
            LossPoint(
                step=p["step"],
                loss=p["loss"],
                learning_rate=p["learning_rate"],
                tokens_per_s=p["tokens_per_s"],
                peak_mib=p["peak_mib"],
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
    return JobCurve(id=job_id, points=point_list, events=event_list, evals=evals)


async def _eval_points(s: AsyncSession, job_id: str) -> list[EvalPoint]:
    rows = await s.execute(
        select(_evals.c.step, _evals.c.eval_loss)
        .where(_evals.c.job_id == job_id)
        .order_by(_evals.c.step)
    )
    return [EvalPoint(step=step, eval_loss=loss) for step, loss in rows]
