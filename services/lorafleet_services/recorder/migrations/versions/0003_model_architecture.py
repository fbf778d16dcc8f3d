"""The catalog keeps each model's architecture (for memory estimates).

Revision ID: 0003
Revises: 0002
Create Date: 2026-12-01
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # Null for models added before: they get no estimate until added again.
    with op.batch_alter_table("models") as batch:
        batch.add_column(sa.Column("architecture", sa.JSON(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("models") as batch:
        batch.drop_column("architecture")
