"""The recorder's tables, as SQLAlchemy Core `Table`s on one `METADATA`.

The schema itself is created by the Alembic migrations (migrations/versions);
these tables describe the same schema for queries and must match it
(tests/recorder/test_migrations.py compares them). Every query in the
recorder is SQLAlchemy Core over these tables, returning row mappings.

Times are stored as timezone-aware UTC (`UtcDateTime`): PostgreSQL keeps the
zone, SQLite keeps naive UTC text that is read back as UTC.
"""

from __future__ import annotations

import datetime as dt
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    Column,
    DateTime,
    Float,
    ForeignKey,
    Index,
    Integer,
    MetaData,
    String,
    Table,
    Text,
)
from sqlalchemy.engine import Dialect
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


METADATA = MetaData()

#: The catalog.
models = Table(
    "models",
    METADATA,
    Column("name", String(64), primary_key=True),
    Column("engine", String(16), nullable=False),
    Column("hf_repo", Text),
    Column("hf_revision", Text, nullable=False),
    Column("local_dir", Text),
    Column("description", Text, nullable=False),
    Column("created_at", UtcDateTime, nullable=False),
    # ModelArchitecture as JSON (migration 0002); null without one.
    Column("architecture", JSON),
    # Migration 0008: ModelSpec.serving ("all" or {"replicas": N}); null: none.
    Column("serving", JSON),
)

#: The jobs. `version` grows by one at every write: the guard of every
#: UPDATE. `last_seq` is the highest status sequence applied; `field_seqs`
#: maps each scalar field a report can set (step, loss, state, ...) to the
#: sequence of the report that set it (the fold's rule: recorder/fold.py).
jobs = Table(
    "jobs",
    METADATA,
    Column("id", String(64), primary_key=True),
    Column("name", Text, nullable=False),
    Column("model", String(64), ForeignKey("models.name"), nullable=False, index=True),
    Column("engine", String(16), nullable=False),
    Column("node", String(64), index=True),
    Column("gpu_memory_mib", Integer, nullable=False),
    Column("dataset", Text, nullable=False),
    Column("dataset_sha256", String(64), nullable=False),
    Column("records", Integer, nullable=False),
    Column("params", JSON, nullable=False),
    Column("state", String(16), nullable=False, index=True),
    Column("message", Text, nullable=False),
    Column("step", Integer, nullable=False),
    Column("steps", Integer, nullable=False),
    Column("loss", Float),
    Column("eval_loss", Float),
    Column("peak_mib", Integer, nullable=False),
    Column("attempt", Integer, nullable=False),
    Column("last_seq", Integer, nullable=False),
    Column("field_seqs", JSON, nullable=False),
    Column("artifacts_expected", JSON, nullable=False),
    Column("artifacts_stored", JSON, nullable=False),
    Column("version", Integer, nullable=False),
    Column("created_at", UtcDateTime, nullable=False, index=True),
    Column("updated_at", UtcDateTime, nullable=False),
    Column("started_at", UtcDateTime),
    Column("finished_at", UtcDateTime),
    # Migration 0004:
    Column("max_attempts", Integer, nullable=False, server_default="1"),
    # The node the submitter named; `node` is where the job is placed now.
    Column("requested_node", String(64)),
    Column("resume_from", String(64)),
    # CheckpointRef as JSON: the newest checkpoint stored.
    Column("checkpoint", JSON),
    # kind -> {"object", "size", "sha256"} of each stored artifact (a later
    # job resumes from the adapter); null: none stored yet.
    Column("artifact_refs", JSON),
    # str(attempt) -> the step it started from (its checkpoint's; 0 afresh).
    Column("attempt_starts", JSON),
    # Migration 0005: JobSpec.serve (null: serve where an engine runs the model).
    Column("serve", Boolean),
    # Migration 0006: JobRecord.tokens_seen (a long run passes 2**31).
    Column("tokens_seen", BigInteger),
    # Migration 0007: the evaluation set (JobRecord.eval_dataset); null: none.
    Column("eval_dataset", Text),
    Column("eval_dataset_sha256", String(64)),
    Column("eval_records", Integer, nullable=False, server_default="0"),
    # Migration 0008: JobSpec.serving; null: the model's default.
    Column("serving", JSON),
    # A DPO job's newest step and held-out numbers (migration 0009).
    Column("preference", JSON),
    Column("eval_preference", JSON),
)

#: One reported optimizer step; (job_id, step, attempt) is stored once.
loss_points = Table(
    "loss_points",
    METADATA,
    Column("job_id", String(64), ForeignKey("jobs.id", ondelete="CASCADE"), primary_key=True),
    Column("step", Integer, primary_key=True),
    Column("loss", Float, nullable=False),
    Column("learning_rate", Float),
    Column("tokens_per_s", Float),
    Column("peak_mib", Integer),
    Column("attempt", Integer, primary_key=True, server_default="1"),
    Column("preference", JSON),
)

#: One evaluation of the held-out records; (job_id, step, attempt) is stored once.
eval_points = Table(
    "eval_points",
    METADATA,
    Column("job_id", String(64), ForeignKey("jobs.id", ondelete="CASCADE"), primary_key=True),
    Column("step", Integer, primary_key=True),
    Column("eval_loss", Float, nullable=False),
    Column("attempt", Integer, primary_key=True, server_default="1"),
    Column("preference", JSON),
)

#: One state change of a job and its reason.
job_events = Table(
    "job_events",
    METADATA,
    Column("id", Integer, primary_key=True, autoincrement=True),
    Column("job_id", String(64), ForeignKey("jobs.id", ondelete="CASCADE"), nullable=False),
    Column("time", UtcDateTime, nullable=False),
    Column("from_state", String(16)),
    Column("to_state", String(16), nullable=False),
    Column("message", Text, nullable=False),
    # A job's events in order, as jobs.get and the event log read them.
    Index("ix_job_events_job_id", "job_id", "id"),
)

#: One adapter on one engine of one node (ServingRecord, migration 0005).
#: `last_seq` is the newest ServingReport.seq applied: an older one is stale.
servings = Table(
    "servings",
    METADATA,
    Column("job_id", String(64), ForeignKey("jobs.id", ondelete="CASCADE"), primary_key=True),
    Column("node", String(64), primary_key=True),
    # The engine's url on its node (EngineRef.url).
    Column("engine", String(512), primary_key=True),
    Column("engine_kind", String(16), nullable=False),
    Column("model", String(64), nullable=False, index=True),
    Column("served_name", Text, nullable=False),
    Column("sha256", String(64), nullable=False),
    Column("state", String(24), nullable=False, index=True),
    Column("reason", Text, nullable=False),
    Column("lift", Text, nullable=False),
    Column("probe_error", Float),
    Column("created_at", UtcDateTime, nullable=False),
    Column("updated_at", UtcDateTime, nullable=False, index=True),
    Column("version", Integer, nullable=False),
    # Migration 0006: big: the agent's seqs are microseconds since the epoch.
    Column("last_seq", BigInteger, nullable=False),
)
