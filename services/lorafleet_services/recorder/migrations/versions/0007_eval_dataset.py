"""A job's evaluation set (JobSpec.eval_data / eval_dataset): its object in
the datasets bucket, that object's sha256 and its record count.

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-02
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # Null (and 0 records) for jobs from before: they held out a share of their data.
    with op.batch_alter_table("jobs") as batch:
        batch.add_column(sa.Column("eval_dataset", sa.Text(), nullable=True))
        batch.add_column(sa.Column("eval_dataset_sha256", sa.String(64), nullable=True))
        batch.add_column(
            sa.Column("eval_records", sa.Integer(), nullable=False, server_default="0")
        )


def downgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.drop_column("eval_records")
        batch.drop_column("eval_dataset_sha256")
        batch.drop_column("eval_dataset")
