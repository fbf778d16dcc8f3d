"""A job's trained tokens (JobRecord.tokens_seen, the trainer's done summary),
and `servings.last_seq` made big: an agent's ServingReport.seq is its clock
in microseconds (plan.ReportSeq), past a 32-bit integer, which
PostgreSQL refused for every report (the batch retried forever).

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-02
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # Null for jobs from before: their trainers' totals were not kept.
    with op.batch_alter_table("jobs") as batch:
        batch.add_column(sa.Column("tokens_seen", sa.BigInteger(), nullable=True))
    with op.batch_alter_table("servings") as batch:
        batch.alter_column("last_seq", type_=sa.BigInteger(), existing_nullable=False)


def downgrade() -> None:
    with op.batch_alter_table("servings") as batch:
        batch.alter_column("last_seq", type_=sa.Integer(), existing_nullable=False)
    with op.batch_alter_table("jobs") as batch:
        batch.drop_column("tokens_seen")
