"""The recorder's tables, as SQLAlchemy declarative models.

The schema itself is created by the Alembic migrations (migrations/versions);
these classes describe the same tables for queries and must match them.

Times are stored as timezone-aware UTC (`UtcDateTime`): PostgreSQL keeps the
zone, SQLite keeps naive UTC text that is read back as UTC.
"""

from __future__ import annotations

import datetime as dt
from typing import Any

from sqlalchemy import JSON, DateTime, Float, ForeignKey, Index, Integer, String, Text
from sqlalchemy.engine import Dialect
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column
from sqlalchemy.types import TypeDecorator


class UtcDateTime(TypeDecorator[dt.datetime]):
    """A timezone-aware UTC datetime on both backends."""

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: dt.datetime | None, dialect: Dialect) -> Any:
        if value is None:
            return None
        if value.tzinfo is None:
            raise ValueError("naive datetime: lorafleet stores UTC times with their zone")
        value = value.astimezone(dt.UTC)
        return value.replace(tzinfo=None) if dialect.name == "sqlite" else value

    def process_result_value(self, value: Any, dialect: Dialect) -> dt.datetime | None:
        if value is None:
            return None
        if not isinstance(value, dt.datetime):
            raise TypeError(f"the database returned {value!r} for a timestamp column")
        if value.tzinfo is None:
            return value.replace(tzinfo=dt.UTC)
        return value.astimezone(dt.UTC)


class Base(DeclarativeBase):
    pass


class Model(Base):
    """A catalog entry."""

    __tablename__ = "models"

    name: Mapped[str] = mapped_column(String(64), primary_key=True)
    engine: Mapped[str] = mapped_column(String(16))
    hf_repo: Mapped[str | None] = mapped_column(Text)
    hf_revision: Mapped[str] = mapped_column(Text)
    local_dir: Mapped[str | None] = mapped_column(Text)
    description: Mapped[str] = mapped_column(Text)
    created_at: Mapped[dt.datetime] = mapped_column(UtcDateTime)
    #: ModelArchitecture as JSON (migration 0002); null without one.
    architecture: Mapped[dict[str, Any] | None] = mapped_column(JSON)


class Job(Base):
    """A job. `version` grows by one at every write: the guard of every UPDATE.

    `last_seq` is the highest status sequence applied; `field_seqs` maps
    each scalar field a report can set (step, loss, state, ...) to the
    sequence of the report that set it, so a late, older report can still
    fill in what no newer report carried, and the result does not depend on
    delivery order.
    """

    __tablename__ = "jobs"

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    name: Mapped[str] = mapped_column(Text)
    model: Mapped[str] = mapped_column(String(64), ForeignKey("models.name"), index=True)
    engine: Mapped[str] = mapped_column(String(16))
    node: Mapped[str | None] = mapped_column(String(64), index=True)
    gpu_memory_mib: Mapped[int] = mapped_column(Integer)
    dataset: Mapped[str] = mapped_column(Text)
    dataset_sha256: Mapped[str] = mapped_column(String(64))
    records: Mapped[int] = mapped_column(Integer)
    params: Mapped[dict[str, Any]] = mapped_column(JSON)
    state: Mapped[str] = mapped_column(String(16), index=True)
    message: Mapped[str] = mapped_column(Text)
    step: Mapped[int] = mapped_column(Integer)
    steps: Mapped[int] = mapped_column(Integer)
    loss: Mapped[float | None] = mapped_column(Float)
    eval_loss: Mapped[float | None] = mapped_column(Float)
    peak_mib: Mapped[int] = mapped_column(Integer)
    attempt: Mapped[int] = mapped_column(Integer)
    last_seq: Mapped[int] = mapped_column(Integer)
    field_seqs: Mapped[dict[str, int]] = mapped_column(JSON)
    artifacts_expected: Mapped[list[str]] = mapped_column(JSON)
    artifacts_stored: Mapped[list[str]] = mapped_column(JSON)
    version: Mapped[int] = mapped_column(Integer)
    created_at: Mapped[dt.datetime] = mapped_column(UtcDateTime, index=True)
    updated_at: Mapped[dt.datetime] = mapped_column(UtcDateTime)
    started_at: Mapped[dt.datetime | None] = mapped_column(UtcDateTime)
    finished_at: Mapped[dt.datetime | None] = mapped_column(UtcDateTime)
    # Migration 0004:
    max_attempts: Mapped[int] = mapped_column(Integer, server_default="1")
    #: The node the submitter named; `node` is where the job is placed now.
    requested_node: Mapped[str | None] = mapped_column(String(64))
    resume_from: Mapped[str | None] = mapped_column(String(64))
    #: CheckpointRef as JSON: the newest checkpoint stored.
    checkpoint: Mapped[dict[str, Any] | None] = mapped_column(JSON)
    #: kind -> {"object", "size", "sha256"} of each stored artifact (a later
    #: job resumes from the adapter); null: none stored yet.
    artifact_refs: Mapped[dict[str, Any] | None] = mapped_column(JSON)
    #: str(attempt) -> the step it started from (its checkpoint's; 0 afresh).
    attempt_starts: Mapped[dict[str, int] | None] = mapped_column(JSON)


class LossPoint(Base):
    """One reported optimizer step; (job_id, step, attempt) is stored once."""

    __tablename__ = "loss_points"

    job_id: Mapped[str] = mapped_column(
        String(64), ForeignKey("jobs.id", ondelete="CASCADE"), primary_key=True
    )
    step: Mapped[int] = mapped_column(Integer, primary_key=True)
    loss: Mapped[float] = mapped_column(Float)
    learning_rate: Mapped[float | None] = mapped_column(Float)
    tokens_per_s: Mapped[float | None] = mapped_column(Float)
    peak_mib: Mapped[int | None] = mapped_column(Integer)
    attempt: Mapped[int] = mapped_column(Integer, primary_key=True, server_default="1")


class EvalPoint(Base):
    """One evaluation of the held-out records; (job_id, step, attempt) is stored once."""

    __tablename__ = "eval_points"

    job_id: Mapped[str] = mapped_column(
        String(64), ForeignKey("jobs.id", ondelete="CASCADE"), primary_key=True
    )
    step: Mapped[int] = mapped_column(Integer, primary_key=True)
    eval_loss: Mapped[float] = mapped_column(Float)
    attempt: Mapped[int] = mapped_column(Integer, primary_key=True, server_default="1")


class JobEventRow(Base):
    """One state change of a job and its reason."""

    __tablename__ = "job_events"
    #: A job's events in order, as jobs.get and the event log read them.
    __table_args__ = (Index("ix_job_events_job_id", "job_id", "id"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    job_id: Mapped[str] = mapped_column(String(64), ForeignKey("jobs.id", ondelete="CASCADE"))
    time: Mapped[dt.datetime] = mapped_column(UtcDateTime)
    from_state: Mapped[str | None] = mapped_column(String(16))
    to_state: Mapped[str] = mapped_column(String(16))
    message: Mapped[str] = mapped_column(Text)
