"""Attempts and checkpoints: a job's max_attempts, the node its submitter
named, the job it resumes from, its newest checkpoint, the stored artifacts'
objects (a later job starts from them), each attempt's start step; loss and
eval points are kept per (step, attempt).

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-01
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        # Jobs from before had one attempt.
        batch.add_column(
            sa.Column("max_attempts", sa.Integer(), nullable=False, server_default="1")
        )
        batch.add_column(sa.Column("requested_node", sa.String(64), nullable=True))
        batch.add_column(sa.Column("resume_from", sa.String(64), nullable=True))
        batch.add_column(sa.Column("checkpoint", sa.JSON(), nullable=True))
        batch.add_column(sa.Column("artifact_refs", sa.JSON(), nullable=True))
        batch.add_column(sa.Column("attempt_starts", sa.JSON(), nullable=True))
    # A queued job's node is the one its submitter named; where an older job
    # ran says nothing of that (and with one attempt it never goes back).
    op.execute("UPDATE jobs SET requested_node = node WHERE state = 'queued'")
    for table in ("loss_points", "eval_points"):
        with op.batch_alter_table(table) as batch:
            batch.add_column(sa.Column("attempt", sa.Integer(), nullable=False, server_default="1"))
            batch.drop_constraint(f"pk_{table}", type_="primary")
            batch.create_primary_key(f"pk_{table}", ["job_id", "step", "attempt"])


def downgrade() -> None:
    for table in ("eval_points", "loss_points"):
        # Only the first attempt's points fit the old key.
        op.execute(f"DELETE FROM {table} WHERE attempt <> 1")
        with op.batch_alter_table(table) as batch:
            batch.drop_constraint(f"pk_{table}", type_="primary")
            batch.create_primary_key(f"pk_{table}", ["job_id", "step"])
            batch.drop_column("attempt")
    with op.batch_alter_table("jobs") as batch:
        for column in (
            "attempt_starts",
            "artifact_refs",
            "checkpoint",
            "resume_from",
            "requested_node",
            "max_attempts",
        ):
            batch.drop_column(column)
