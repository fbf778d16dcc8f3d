"""Serving: a job's `serve` wish, and one `servings` row per (job, node,
engine) holding its ServingRecord and the newest report's sequence.

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-02
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None

_TS = sa.DateTime(timezone=True)


def upgrade() -> None:
    # Null for jobs from before: serve where an engine runs the model (the default).
    with op.batch_alter_table("jobs") as batch:
        batch.add_column(sa.Column("serve", sa.Boolean(), nullable=True))
    op.create_table(
        "servings",
        sa.Column(
            "job_id",
            sa.String(64),
            sa.ForeignKey("jobs.id", ondelete="CASCADE"),
            primary_key=True,
        ),
        sa.Column("node", sa.String(64), primary_key=True),
        sa.Column("engine", sa.String(512), primary_key=True),
        sa.Column("engine_kind", sa.String(16), nullable=False),
        sa.Column("model", sa.String(64), nullable=False),
        sa.Column("served_name", sa.Text(), nullable=False),
        sa.Column("sha256", sa.String(64), nullable=False),
        sa.Column("state", sa.String(24), nullable=False),
        sa.Column("reason", sa.Text(), nullable=False),
        sa.Column("lift", sa.Text(), nullable=False),
        sa.Column("probe_error", sa.Float(), nullable=True),
        sa.Column("created_at", _TS, nullable=False),
        sa.Column("updated_at", _TS, nullable=False),
        sa.Column("version", sa.Integer(), nullable=False),
        sa.Column("last_seq", sa.Integer(), nullable=False),
    )
    op.create_index("ix_servings_model", "servings", ["model"])
    op.create_index("ix_servings_state", "servings", ["state"])
    op.create_index("ix_servings_updated_at", "servings", ["updated_at"])


def downgrade() -> None:
    op.drop_table("servings")
    with op.batch_alter_table("jobs") as batch:
        batch.drop_column("serve")
