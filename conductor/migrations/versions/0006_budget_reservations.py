"""step.reserved_usd / reserved_tokens: what a running step (or a recursive step's child job) may still
spend, held against its job's budgets from its claim until its outcome is recorded

Revision ID: 0006_budget_reservations
Revises: 0005_batches
Create Date: 2026-11-23
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0006_budget_reservations"
down_revision = "0005_batches"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("step") as batch:
        batch.add_column(sa.Column("reserved_usd", sa.Float(), nullable=False, server_default="0"))
        batch.add_column(sa.Column("reserved_tokens", sa.Integer(), nullable=False, server_default="0"))


def downgrade() -> None:
    with op.batch_alter_table("step") as batch:
        batch.drop_column("reserved_tokens")
        batch.drop_column("reserved_usd")
