"""A DPO job's numbers: its newest step and held-out ones on the job, and
each step's and each evaluation's on its curve point (JSON objects: the
rewards, margin and preference accuracy; null for a supervised job).

Revision ID: 0009
Revises: 0008
Create Date: 2026-12-05
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0009"
down_revision = "0008"
branch_labels = None
depends_on = None

_COLUMNS = {
    "jobs": ("preference", "eval_preference"),
    "loss_points": ("preference",),
    "eval_points": ("preference",),
}


def upgrade() -> None:
    for table, columns in _COLUMNS.items():
        with op.batch_alter_table(table) as batch:
            for column in columns:
                batch.add_column(sa.Column(column, sa.JSON(), nullable=True))


def downgrade() -> None:
    for table, columns in _COLUMNS.items():
        with op.batch_alter_table(table) as batch:
            for column in columns:
                batch.drop_column(column)
