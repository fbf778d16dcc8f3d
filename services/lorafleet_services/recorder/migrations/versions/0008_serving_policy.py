"""Serving policies: a job's (JobSpec.serving) and a catalog model's default
(ModelSpec.serving), "all" or {"replicas": N} as JSON.

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-05
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # Null for rows from before: served only where they trained, as then.
    with op.batch_alter_table("jobs") as batch:
        batch.add_column(sa.Column("serving", sa.JSON(), nullable=True))
    with op.batch_alter_table("models") as batch:
        batch.add_column(sa.Column("serving", sa.JSON(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("models") as batch:
        batch.drop_column("serving")
    with op.batch_alter_table("jobs") as batch:
        batch.drop_column("serving")
