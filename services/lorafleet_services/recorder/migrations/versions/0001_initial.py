"""The recorder's first schema: catalog, jobs, loss curve, job events.

Revision ID: 0001
Revises:
Create Date: 2026-11-29
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None

_TS = sa.DateTime(timezone=True)


def upgrade() -> None:
    _create_models()
    _create_jobs()
    _create_loss_points()
    _create_job_events()


# One helper per table, in creation order (jobs refer to models; the rest to jobs).


def _create_models() -> None:
    op.create_table(
        "models",
        sa.Column("name", sa.String(64), primary_key=True),
        sa.Column("engine", sa.String(16), nullable=False),
        sa.Column("hf_repo", sa.Text(), nullable=True),
        sa.Column("hf_revision", sa.Text(), nullable=False),
        sa.Column("local_dir", sa.Text(), nullable=True),
        sa.Column("description", sa.Text(), nullable=False),
        sa.Column("created_at", _TS, nullable=False),
        sa.CheckConstraint("engine IN ('vllm', 'llamacpp')", name="ck_models_engine"),
    )


def _create_jobs() -> None:
    op.create_table(
        "jobs",
        sa.Column("id", sa.String(64), primary_key=True),
        sa.Column("name", sa.Text(), nullable=False),
        sa.Column("model", sa.String(64), sa.ForeignKey("models.name"), nullable=False),
        sa.Column("engine", sa.String(16), nullable=False),
        sa.Column("node", sa.String(64), nullable=True),
        sa.Column("gpu_memory_mib", sa.Integer(), nullable=False),
        sa.Column("dataset", sa.Text(), nullable=False),
        sa.Column("dataset_sha256", sa.String(64), nullable=False),
        sa.Column("records", sa.Integer(), nullable=False),
        sa.Column("params", sa.JSON(), nullable=False),
        sa.Column("state", sa.String(16), nullable=False),
        sa.Column("message", sa.Text(), nullable=False),
        sa.Column("step", sa.Integer(), nullable=False),
        sa.Column("steps", sa.Integer(), nullable=False),
        sa.Column("loss", sa.Float(), nullable=True),
        sa.Column("eval_loss", sa.Float(), nullable=True),
        sa.Column("peak_mib", sa.Integer(), nullable=False),
        sa.Column("attempt", sa.Integer(), nullable=False),
        sa.Column("last_seq", sa.Integer(), nullable=False),
        sa.Column("field_seqs", sa.JSON(), nullable=False),
        sa.Column("artifacts_expected", sa.JSON(), nullable=False),
        sa.Column("artifacts_stored", sa.JSON(), nullable=False),
        sa.Column("version", sa.Integer(), nullable=False),
        sa.Column("created_at", _TS, nullable=False),
        sa.Column("updated_at", _TS, nullable=False),
        sa.Column("started_at", _TS, nullable=True),
        sa.Column("finished_at", _TS, nullable=True),
        sa.CheckConstraint("gpu_memory_mib > 0", name="ck_jobs_gpu_memory_mib"),
    )
    op.create_index("ix_jobs_state", "jobs", ["state"])
    op.create_index("ix_jobs_node", "jobs", ["node"])
    op.create_index("ix_jobs_model", "jobs", ["model"])
    op.create_index("ix_jobs_created_at", "jobs", ["created_at"])


def _create_loss_points() -> None:
    op.create_table(
        "loss_points",
        sa.Column(
            "job_id", sa.String(64), sa.ForeignKey("jobs.id", ondelete="CASCADE"), nullable=False
        ),
        sa.Column("step", sa.Integer(), nullable=False),
        sa.Column("loss", sa.Float(), nullable=False),
        sa.Column("learning_rate", sa.Float(), nullable=True),
        sa.Column("tokens_per_s", sa.Float(), nullable=True),
        sa.Column("peak_mib", sa.Integer(), nullable=True),
        sa.PrimaryKeyConstraint("job_id", "step", name="pk_loss_points"),
    )


def _create_job_events() -> None:
    op.create_table(
        "job_events",
        sa.Column("id", sa.Integer(), primary_key=True, autoincrement=True),
        sa.Column(
            "job_id", sa.String(64), sa.ForeignKey("jobs.id", ondelete="CASCADE"), nullable=False
        ),
        sa.Column("time", _TS, nullable=False),
        sa.Column("from_state", sa.String(16), nullable=True),
        sa.Column("to_state", sa.String(16), nullable=False),
        sa.Column("message", sa.Text(), nullable=False),
    )
    op.create_index("ix_job_events_job_id", "job_events", ["job_id", "id"])


def downgrade() -> None:
    op.drop_table("job_events")
    op.drop_table("loss_points")
    op.drop_index("ix_jobs_created_at", "jobs")
    op.drop_index("ix_jobs_model", "jobs")
    op.drop_index("ix_jobs_node", "jobs")
    op.drop_index("ix_jobs_state", "jobs")
    op.drop_table("jobs")
    op.drop_table("models")
