"""The recorder's store: the catalog, jobs, transitions and curves over an async sessionmaker.

Each function is one short transaction and never touches the network; the
service publishes events only after these return (after commit). Every
write to a job is guarded: a transition compare-and-sets the state (of two
racing transitions one is applied, the other returns `applied=False` and
the job as it is now); the other writes (status batches, artifacts, resume:
job_writes.py) compare-and-set the row's `version` and are redone from a
fresh read when another writer won. Either way exactly one writer wins, on
PostgreSQL and on SQLite.

Attempts: each move to `starting` counts one and records the step it starts
from (`attempt_starts`: its own checkpoint's, else 0); `curve` returns the
effective curve (`fold.effective`).
"""

from __future__ import annotations

import datetime as dt
import uuid
from collections.abc import Iterable, Mapping
from typing import Any, NamedTuple

import msgspec
from sqlalchemy import Text, Update, cast, delete, func, insert, or_, select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncSession

from lorafleet.errors import NotFoundError
from lorafleet.states import (
    FINAL,
    REQUEUE_FROM,
    IllegalTransitionError,
    can_requeue,
    check_move,
)
from lorafleet_schemas.messages import (
    ArtifactKind,
    CheckpointRef,
    Engine,
    JobCurve,
    JobRecord,
    JobSpec,
    JobState,
    ModelRecord,
    ModelSpec,
)
from lorafleet_services.recorder.db import Sessions
from lorafleet_services.recorder.fold import effective
from lorafleet_services.recorder.rows import (
    eval_point,
    event_record,
    event_row,
    job_record,
    loss_point,
    model_record,
    plain,
    start_ref,
)
from lorafleet_services.recorder.tables import (
    eval_points,
    job_events,
    jobs,
    loss_points,
    models,
    servings,
)


class StoreError(Exception):
    """Base of the errors the store raises for a request it cannot satisfy."""


class NoSuchJobError(StoreError):
    """No job of that id."""


class ModelExistsError(StoreError):
    """A catalog entry of that name exists already."""


class ArtifactKindError(StoreError):
    """An artifact kind the job does not make."""


class CheckpointFieldsError(StoreError):
    """A checkpoint reported without its step, attempt or object."""


class ArtifactNeededError(StoreError):
    """Retention asked to forget an artifact of a job that is not final."""


class NotDeletableError(StoreError):
    """A job whose record something still needs (active, served, started from)."""


class NotResumableError(StoreError):
    """A resume the job's state or stored checkpoints do not allow."""


def now() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


def new_job_id() -> str:
    """A job id: 16 hex digits, safe in a subject and short enough to type."""
    return uuid.uuid4().hex[:16]


async def load_job(s: AsyncSession, job_id: str) -> dict[str, Any] | None:
    """The job's row as a dict (None: no such job), in session `s`."""
    row = (await s.execute(select(jobs).where(jobs.c.id == job_id))).mappings().first()
    return plain(row) if row is not None else None


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
        "serving": msgspec.to_builtins(spec.serving),
    }
    try:
        async with sm() as s, s.begin():
            await s.execute(insert(models).values(**row))
    except IntegrityError:
        raise ModelExistsError(spec.name) from None
    return model_record(row)


async def list_models(sm: Sessions) -> list[ModelRecord]:
    async with sm() as s, s.begin():
        rows = (await s.execute(select(models).order_by(models.c.name))).mappings().all()
    return [model_record(r) for r in rows]


async def get_model(sm: Sessions, name: str) -> ModelRecord | None:
    async with sm() as s, s.begin():
        row = (await s.execute(select(models).where(models.c.name == name))).mappings().first()
    return model_record(row) if row is not None else None


# --- jobs ---------------------------------------------------------------------


class StoredData(NamedTuple):
    """Checked records in the datasets bucket: the object, its sha256, how many."""

    name: str
    sha256: str
    records: int


def eval_columns(eval_set: StoredData | None) -> dict[str, Any]:
    """A job row's columns of its evaluation set (none: null, 0 records)."""
    if eval_set is None:
        return {"eval_dataset": None, "eval_dataset_sha256": None, "eval_records": 0}
    return {
        "eval_dataset": eval_set.name,
        "eval_dataset_sha256": eval_set.sha256,
        "eval_records": eval_set.records,
    }


async def create_job(
    sm: Sessions,
    spec: JobSpec,
    model: ModelRecord,
    dataset: str,
    dataset_sha256: str,
    records: int,
    job_id: str | None = None,
    eval_set: StoredData | None = None,
) -> JobRecord:
    """Insert a queued job for `spec` (already checked) and its first job
    event; `eval_set`: its evaluation set, if it has one."""
    t = now()
    gguf = [ArtifactKind.GGUF.value] if model.engine is Engine.LLAMACPP else []
    expected = [ArtifactKind.PEFT.value, *gguf]
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
        "tokens_seen": None,
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
        "serve": spec.serve,
        "serving": msgspec.to_builtins(spec.serving),  # null: the model's default
        **eval_columns(eval_set),
    }
    async with sm() as s, s.begin():
        await s.execute(insert(jobs).values(**row))
        await s.execute(
            insert(job_events).values(event_row(row["id"], t, None, JobState.QUEUED, "submitted"))
        )
    return job_record(row)


async def get_job(sm: Sessions, job_id: str) -> JobRecord | None:
    async with sm() as s, s.begin():
        row = await load_job(s, job_id)
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
    ids: Iterable[str] = (),
    after: str | None = None,
    placed: bool = False,
) -> list[JobRecord]:
    """Jobs matching every filter given (`state` joins `states`; `ids`: these
    jobs only; `placed`: JobListRequest.placed); newest first by default;
    `after`: those past that job in this order (the next page; a job unknown
    is a NotFoundError)."""
    wanted = {s.value for s in states}
    if state is not None:
        wanted.add(state.value)
    q = select(jobs)
    only = sorted(set(ids))
    if only:
        q = q.where(jobs.c.id.in_(only))
    if wanted:
        q = q.where(jobs.c.state.in_(sorted(wanted)))
    if node is not None:
        q = q.where(jobs.c.node == node)
    if model is not None:
        q = q.where(jobs.c.model == model)
    if placed:
        q = q.where(_placed())
    if oldest_first:
        q = q.order_by(jobs.c.created_at.asc(), jobs.c.id.asc())
    else:
        q = q.order_by(jobs.c.created_at.desc(), jobs.c.id.desc())
    async with sm() as s, s.begin():
        if after is not None:
            mark = (await s.execute(select(jobs.c.created_at).where(jobs.c.id == after))).scalar()
            if mark is None:
                raise NotFoundError(
                    f"no job {after!r} (after): give the last id of a page", "$.after"
                )
            if oldest_first:
                past = or_(
                    jobs.c.created_at > mark, (jobs.c.created_at == mark) & (jobs.c.id > after)
                )
            else:
                past = or_(
                    jobs.c.created_at < mark, (jobs.c.created_at == mark) & (jobs.c.id < after)
                )
            q = q.where(past)
        rows = (await s.execute(q.limit(limit))).mappings().all()
    return [job_record(r) for r in rows]


def _has_policy(column: Any) -> Any:
    """A serving policy column set: neither SQL NULL (rows from before the
    column) nor JSON null, which the JSON type stores for None (the
    policy's text: PostgreSQL's json has no equality)."""
    return column.is_not(None) & (cast(column, Text) != "null")


def _placed() -> Any:
    """A job a serving policy places (fleet_serving.policy_of, in SQL)."""
    defaults = select(models.c.name).where(_has_policy(models.c.serving))
    return or_(jobs.c.serve.is_(None), jobs.c.serve.is_(True)) & or_(
        _has_policy(jobs.c.serving), jobs.c.model.in_(defaults)
    )


async def job_counts(sm: Sessions) -> tuple[dict[str, int], dt.datetime | None]:
    """Jobs by state, and when the oldest queued job was created (None: none queued)."""
    by_state = select(jobs.c.state, func.count()).group_by(jobs.c.state)
    oldest = select(func.min(jobs.c.created_at)).where(jobs.c.state == JobState.QUEUED.value)
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
    *,
    moved: bool = False,
) -> tuple[bool, JobRecord]:
    """Compare-and-set the job's state; return (applied, the job as it is now).

    Applied only when the job is in `from_state` and, when `node` is given
    and the job has a node, on that node. Moving to `starting` stamps
    `started_at`, counts an attempt (whose status sequence starts afresh),
    records the step it starts from and sets the node when given; a final
    state stamps `finished_at`. Raises IllegalTransitionError for a move the
    state machine forbids (and for `done`, which only storing every artifact
    reaches), NoSuchJobError for an unknown job.

    queued -> queued is not a move: it sets the message of a job that is
    still queued (the scheduler says what the job waits for), records no
    event, and is applied only when the message changes.

    on a node -> queued is the requeue (`lorafleet.states`): applied only
    while the job has attempts left; the job's node goes back to the one
    its submitter named. `moved` (a drain's move_training, not a loss):
    applied whatever the attempts left, max_attempts grown by one."""
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
    guard, values = _move_statement(job_id, from_state, to_state, message, node, t, moved)
    async with sm() as s, s.begin():
        if requeue and not moved:
            _check_attempts_left(await load_job(s, job_id), from_state)
        if to_state is JobState.STARTING:
            before = await load_job(s, job_id)
            if before is not None:
                values.update(_starting_values(before, t))
                # The attempt counted is the one read: the same row, or no move.
                guard = guard.where(jobs.c.attempt == before["attempt"])
        result = await s.execute(guard.values(**values))
        applied = result.rowcount == 1  # type: ignore[attr-defined]
        if applied:
            await s.execute(
                insert(job_events).values(event_row(job_id, t, from_state, to_state, message))
            )
        row = await load_job(s, job_id)
    if row is None:
        raise NoSuchJobError(job_id)
    return applied, job_record(row)


def _move_statement(
    job_id: str,
    from_state: JobState,
    to_state: JobState,
    message: str,
    node: str | None,
    t: dt.datetime,
    moved: bool = False,
) -> tuple[Update, dict[str, Any]]:
    """The guarded UPDATE of a transition (see `transition`) and its values."""
    requeue = to_state is JobState.QUEUED and from_state in REQUEUE_FROM
    values: dict[str, Any] = {
        "state": to_state.value,
        "message": message,
        "updated_at": t,
        "version": jobs.c.version + 1,
    }
    if node is not None:
        values["node"] = node
    if requeue:
        values["node"] = jobs.c.requested_node
    if to_state in FINAL:
        values["finished_at"] = t
    guard = update(jobs).where(jobs.c.id == job_id, jobs.c.state == from_state.value)
    if node is not None:
        guard = guard.where(or_(jobs.c.node.is_(None), jobs.c.node == node))
    if requeue and moved:
        values["max_attempts"] = jobs.c.max_attempts + 1
    elif requeue:
        guard = guard.where(jobs.c.attempt < jobs.c.max_attempts)
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
    guard = update(jobs).where(
        jobs.c.id == job_id,
        jobs.c.state == JobState.QUEUED.value,
        jobs.c.message != message,
    )
    async with sm() as s, s.begin():
        result = await s.execute(
            guard.values(message=message, updated_at=now(), version=jobs.c.version + 1)
        )
        applied = result.rowcount == 1  # type: ignore[attr-defined]
        row = await load_job(s, job_id)
    if row is None:
        raise NoSuchJobError(job_id)
    return applied, job_record(row)


# --- the curve ------------------------------------------------------------------


async def curve(sm: Sessions, job_id: str) -> JobCurve:
    """The job's effective loss and eval curves (by step; see `fold.effective`)
    and its state changes (in order)."""
    async with sm() as s, s.begin():
        job = await load_job(s, job_id)
        if job is None:
            raise NoSuchJobError(job_id)
        points = await s.execute(
            select(loss_points)
            .where(loss_points.c.job_id == job_id)
            .order_by(loss_points.c.step, loss_points.c.attempt)
        )
        evals = await s.execute(
            select(eval_points)
            .where(eval_points.c.job_id == job_id)
            .order_by(eval_points.c.step, eval_points.c.attempt)
        )
        events = await s.execute(
            select(job_events).where(job_events.c.job_id == job_id).order_by(job_events.c.id)
        )
    starts = {int(a): step for a, step in (job["attempt_starts"] or {}).items()}
    return JobCurve(
        id=job_id,
        points=effective([loss_point(p) for p in points.mappings()], starts),
        events=[event_record(e) for e in events.mappings()],
        evals=effective([eval_point(p) for p in evals.mappings()], starts),
    )


# --- resume ---------------------------------------------------------------------


async def resume_source(sm: Sessions, job_id: str) -> tuple[JobRecord, CheckpointRef | None] | None:
    """The job a new job resumes from (JobSpec.resume_from) and what it would
    start from (its newest checkpoint, else its adapter); None: no such job."""
    async with sm() as s, s.begin():
        row = await load_job(s, job_id)
    if row is None:
        return None
    return job_record(row), start_ref(row)


#: Serving states in which an engine holds a job's adapter (or is about to).
_HOLDING = ("loading", "served", "restart_required")


async def delete_job(sm: Sessions, job_id: str) -> JobRecord:
    """Delete a final job's row (its events, curves and serving records go
    with it: ON DELETE CASCADE); the record as it was. NoSuchJobError, or
    NotDeletableError saying what to do first."""
    async with sm() as s, s.begin():
        row = await load_job(s, job_id)
        if row is None:
            raise NoSuchJobError(job_id)
        state = JobState(row["state"])
        if state not in FINAL:
            raise NotDeletableError(f"job {job_id} is {state.value}: cancel it first")
        held = (
            await s.execute(
                select(servings.c.node)
                .where(servings.c.job_id == job_id, servings.c.state.in_(_HOLDING))
                .limit(1)
            )
        ).scalar()
        if held is not None:
            raise NotDeletableError(
                f"job {job_id}'s adapter is served on {held}: `lorafleet unserve {job_id}` first"
            )
        starting = (
            await s.execute(
                select(jobs.c.id)
                .where(jobs.c.resume_from == job_id, jobs.c.state.notin_([f.value for f in FINAL]))
                .limit(1)
            )
        ).scalar()
        if starting is not None:
            raise NotDeletableError(
                f"job {starting} starts from job {job_id}: delete {job_id} once it has ended"
            )
        gone = await s.execute(
            delete(jobs).where(jobs.c.id == job_id, jobs.c.version == row["version"])
        )
        if gone.rowcount != 1:  # type: ignore[attr-defined]
            raise NotDeletableError(f"job {job_id} changed while being deleted: try again")
    return job_record(row)
