"""step.resent_at: when the reconciler last re-sent a running step whose worker's lease expired, so those
re-sends back off exponentially like a queued step's instead of going out at every pass

Revision ID: 0012_step_resent_at
Revises: 0011_tenant_in_flight
Create Date: 2026-11-24
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0012_step_resent_at"
down_revision = "0011_tenant_in_flight"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("step") as batch:
        batch.add_column(sa.Column("resent_at", sa.DateTime(timezone=True), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("step") as batch:
        batch.drop_column("resent_at")
