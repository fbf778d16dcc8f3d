"""The boundary between the recorder's rows and the wire's records.

A row is a plain dict of a table's columns (tables.py; JSON columns hold
builtins). Each conversion is written once here: a row becomes a record by
`msgspec.convert` (strict: a column the record cannot take is an error,
columns the record does not have are ignored), plus the few fields that
are not a column of the same name (a job's `adapter`, from its
`artifact_refs`).
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Mapping
from typing import Any

import msgspec

from lorafleet_schemas.messages import (
    ArtifactKind,
    CheckpointRef,
    EvalPoint,
    JobEventRecord,
    JobRecord,
    JobState,
    LossPoint,
    ModelRecord,
    ServingRecord,
    StatusReport,
)

#: A row as SQLAlchemy returns it (`RowMapping`) or as the store keeps it (a dict).
Row = Mapping[Any, Any]


def plain(row: Row) -> dict[str, Any]:
    """`row` as a dict keyed by plain strings (SQLAlchemy's column names are a
    `str` subclass, which msgspec does not take as a field name)."""
    return {str(k): v for k, v in row.items()}


def model_record(row: Row) -> ModelRecord:
    """A `models` row as the catalog's ModelRecord."""
    return msgspec.convert(plain(row), ModelRecord)


def job_record(row: Row) -> JobRecord:
    """The one conversion of a `jobs` row to the wire's JobRecord."""
    adapter = artifact_ref(row, ArtifactKind.PEFT)
    fields = {**plain(row), "adapter": None if adapter is None else msgspec.to_builtins(adapter)}
    return msgspec.convert(fields, JobRecord)


def serving_record(row: Row) -> ServingRecord:
    """A `servings` row as the wire's ServingRecord (its `last_seq` stays behind)."""
    return msgspec.convert(plain(row), ServingRecord)


def artifact_ref(row: Row, kind: ArtifactKind) -> CheckpointRef | None:
    """The stored `kind` artifact of a job row as a ref to start from, if stored."""
    stored = (row["artifact_refs"] or {}).get(kind.value)
    if stored is None:
        return None
    return CheckpointRef(job_id=row["id"], kind=kind, **stored)


def start_ref(row: Row) -> CheckpointRef | None:
    """What a job started from another job's work (`row`) starts from: its
    newest checkpoint, else its adapter."""
    if row["checkpoint"] is not None:
        return msgspec.convert(row["checkpoint"], CheckpointRef)
    return artifact_ref(row, ArtifactKind.PEFT)


def event_row(
    job_id: str, time: dt.datetime, from_state: JobState | None, to_state: JobState, message: str
) -> dict[str, Any]:
    """The `job_events` row of one state change."""
    return {
        "job_id": job_id,
        "time": time,
        "from_state": from_state.value if from_state is not None else None,
        "to_state": to_state.value,
        "message": message,
    }


def event_record(row: Row) -> JobEventRecord:
    """A `job_events` row as the curve's JobEventRecord."""
    return msgspec.convert(plain(row), JobEventRecord)


def loss_point_row(job_id: str, r: StatusReport) -> dict[str, Any]:
    """The `loss_points` row of a report that carries a step and its loss."""
    return {
        "job_id": job_id,
        "step": r.step,
        "loss": r.loss,
        "learning_rate": r.learning_rate,
        "tokens_per_s": r.tokens_per_s,
        "peak_mib": r.peak_mib,
        "attempt": r.attempt,
        "preference": r.preference,
    }


def eval_point_row(job_id: str, r: StatusReport) -> dict[str, Any]:
    """The `eval_points` row of a report that carries a step and its eval loss."""
    return {
        "job_id": job_id, "step": r.step, "eval_loss": r.eval_loss, "attempt": r.attempt,
        "preference": r.eval_preference,
    }  # fmt: skip


def loss_point(row: Row) -> LossPoint:
    return msgspec.convert(plain(row), LossPoint)


def eval_point(row: Row) -> EvalPoint:
    return msgspec.convert(plain(row), EvalPoint)
