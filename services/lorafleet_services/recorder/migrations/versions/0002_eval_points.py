"""The eval-loss curve: one row per evaluated step (`lorafleet jobs show` plots it).

Revision ID: 0002
Revises: 0001
Create Date: 2026-12-01
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "eval_points",
        sa.Column(
            "job_id", sa.String(64), sa.ForeignKey("jobs.id", ondelete="CASCADE"), nullable=False
        ),
        sa.Column("step", sa.Integer(), nullable=False),
        sa.Column("eval_loss", sa.Float(), nullable=False),
        sa.PrimaryKeyConstraint("job_id", "step", name="pk_eval_points"),
    )


def downgrade() -> None:
    op.drop_table("eval_points")
