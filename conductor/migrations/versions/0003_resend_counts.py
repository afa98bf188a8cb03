"""step.resends, job.plan_resends: the reconciler backs off exponentially per message it re-sends

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-22
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("step") as batch:
        batch.add_column(sa.Column("resends", sa.Integer(), nullable=False, server_default="0"))
    with op.batch_alter_table("job") as batch:
        batch.add_column(sa.Column("plan_resends", sa.Integer(), nullable=False, server_default="0"))


def downgrade() -> None:
    with op.batch_alter_table("job") as batch:
        batch.drop_column("plan_resends")
    with op.batch_alter_table("step") as batch:
        batch.drop_column("resends")
