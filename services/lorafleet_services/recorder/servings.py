"""The serving records: one row per (job, node, engine), kept from the agents'
ServingReports, and read by `api.adapters.list`.

A report applies when its `seq` is newer than the row's `last_seq` (the
agent's sequence grows per node, so a report delivered twice or late
changes nothing); the row takes every field of the report and its
`version` grows by one. A batch is one transaction, guarded as the job
writes are (job_writes.until_unraced): an UPDATE compares the version
read, an INSERT that meets a row another writer made first is redone from
a fresh read. No network call happens inside; the caller publishes each
change (with its job) after commit.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from sqlalchemy import String, func, insert, select, tuple_, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncSession

from lorafleet_schemas.messages import (
    AdapterKey,
    JobRecord,
    ServingRecord,
    ServingReport,
    ServingState,
)
from lorafleet_services.recorder.db import Sessions
from lorafleet_services.recorder.job_writes import GuardMissedError, until_unraced
from lorafleet_services.recorder.rows import job_record, plain, serving_record
from lorafleet_services.recorder.store import now
from lorafleet_services.recorder.tables import jobs, servings

#: The fields a report sets on its row, besides its key and sequence.
REPORTED = (
    "engine_kind",
    "model",
    "served_name",
    "sha256",
    "state",
    "reason",
    "lift",
    "probe_error",
)


@dataclass(frozen=True, slots=True)
class ServingChange:
    """A serving record as committed, and its job (for the event)."""

    job: JobRecord
    serving: ServingRecord


@dataclass
class ServingResult:
    changes: list[ServingChange] = field(default_factory=list)
    #: Reports older than (or as old as) the row's newest: nothing to do.
    stale: list[ServingReport] = field(default_factory=list)
    #: Reports that cannot apply, and why (no such job).
    refused: list[tuple[ServingReport, str]] = field(default_factory=list)


def too_long(report: ServingReport) -> str | None:
    """Why `report` cannot be stored (a text wider than its column), or None.
    PostgreSQL would refuse the whole batch, every redelivery; SQLite would
    take it: refused alike on both."""
    for name in ("node", "engine", "model"):
        column = servings.c[name].type
        width = column.length if isinstance(column, String) else None
        value = getattr(report, name)
        if width is not None and len(value) > width:
            return f"{name} is {len(value)} characters; the recorder stores {width} at most"
    return None


def _key(r: ServingReport | ServingRecord) -> tuple[str, str, str]:
    return r.job_id, r.node, r.engine


def _values(report: ServingReport) -> dict[str, Any]:
    values = {name: getattr(report, name) for name in REPORTED}
    values["engine_kind"] = report.engine_kind.value
    values["state"] = report.state.value
    return values


async def apply_reports(sm: Sessions, reports: Sequence[ServingReport]) -> ServingResult:
    """Apply a batch of serving reports in one transaction; the result lists
    each record changed, for publishing after commit. Each report says the
    whole record, so of one record's reports in a batch only the newest is
    written: the others are stale already."""
    newest: dict[tuple[str, str, str], ServingReport] = {}
    superseded: list[ServingReport] = []
    for r in sorted(reports, key=lambda r: r.seq, reverse=True):
        if _key(r) in newest:
            superseded.append(r)
        else:
            newest[_key(r)] = r
    result = await until_unraced(partial(_apply_once, sm, [newest[k] for k in sorted(newest)]))
    result.stale.extend(superseded)
    return result


async def _apply_once(sm: Sessions, reports: list[ServingReport]) -> ServingResult:
    result = ServingResult()
    t = now()
    try:
        async with sm() as s, s.begin():
            job_ids = sorted({r.job_id for r in reports})
            job_rows = {
                r["id"]: plain(r)
                for r in (await s.execute(select(jobs).where(jobs.c.id.in_(job_ids)))).mappings()
            }
            rows = await _rows(s, job_ids)
            changed: dict[tuple[str, str, str], dict[str, Any]] = {}
            for report in reports:
                why = too_long(report) or (
                    f"no job {report.job_id}" if report.job_id not in job_rows else None
                )
                if why is not None:
                    result.refused.append((report, why))
                    continue
                row = rows.get(_key(report))
                if row is not None and report.seq <= row["last_seq"]:
                    result.stale.append(report)
                    continue
                rows[_key(report)] = await _write(s, row, report, t)
                changed[_key(report)] = rows[_key(report)]
    except IntegrityError:
        # Another writer inserted one of these rows first: redo from a fresh read.
        raise GuardMissedError("servings") from None
    result.changes = [
        ServingChange(job_record(job_rows[key[0]]), serving_record(row))
        for key, row in sorted(changed.items())
    ]
    return result


async def _rows(s: AsyncSession, job_ids: list[str]) -> dict[tuple[str, str, str], dict[str, Any]]:
    found = await s.execute(select(servings).where(servings.c.job_id.in_(job_ids)))
    return {(r["job_id"], r["node"], r["engine"]): plain(r) for r in found.mappings()}


async def _write(
    s: AsyncSession, row: dict[str, Any] | None, report: ServingReport, t: Any
) -> dict[str, Any]:
    """Insert or update (guarded by the version read) the row of `report`."""
    values = {**_values(report), "last_seq": report.seq, "updated_at": t}
    if row is None:
        new = {
            "job_id": report.job_id,
            "node": report.node,
            "engine": report.engine,
            "created_at": t,
            "version": 1,
            **values,
        }
        await s.execute(insert(servings).values(**new))
        return new
    version = row["version"] + 1
    written = await s.execute(
        update(servings)
        .where(
            servings.c.job_id == row["job_id"],
            servings.c.node == row["node"],
            servings.c.engine == row["engine"],
            servings.c.version == row["version"],
        )
        .values(**values, version=version)
    )
    if written.rowcount != 1:  # type: ignore[attr-defined]
        raise GuardMissedError(row["job_id"])
    return {**row, **values, "version": version}


async def list_records(
    sm: Sessions,
    *,
    job_ids: Iterable[str] = (),
    node: str | None = None,
    model: str | None = None,
    state: ServingState | None = None,
    limit: int = 200,
    after: AdapterKey | None = None,
) -> list[ServingRecord]:
    """Serving records matching every filter given, newest change first; with
    `after`, those past it in key order (AdapterListRequest.after)."""
    q = select(servings)
    wanted = sorted(set(job_ids))
    if wanted:
        q = q.where(servings.c.job_id.in_(wanted))
    if node is not None:
        q = q.where(servings.c.node == node)
    if model is not None:
        q = q.where(servings.c.model == model)
    if state is not None:
        q = q.where(servings.c.state == state.value)
    key = (servings.c.job_id, servings.c.node, servings.c.engine)
    if after is not None:
        q = q.where(tuple_(*key) > tuple_(after.job_id, after.node, after.engine))
        q = q.order_by(*key)
    else:
        q = q.order_by(servings.c.updated_at.desc(), *key)
    async with sm() as s, s.begin():
        rows = (await s.execute(q.limit(limit))).mappings().all()
    return [serving_record(r) for r in rows]


async def state_counts(sm: Sessions) -> dict[str, int]:
    """Serving records by state (the metrics gauge)."""
    q = select(servings.c.state, func.count()).group_by(servings.c.state)
    async with sm() as s, s.begin():
        return {state: int(n) for state, n in (await s.execute(q)).all()}
