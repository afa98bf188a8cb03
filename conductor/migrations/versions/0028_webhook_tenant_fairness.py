"""webhook_delivery.deferrals, and a partial index on the pending deliveries by tenant: a delivery's claim
counts its tenant's attempts in flight (at most ``CONDUCTOR_WEBHOOK_TENANT_MAX_IN_FLIGHT``) and its
waiting deliveries, so that one tenant's slow or silent receivers cannot take every webhooks worker slot.

Additive, for a rolling deploy: a NOT NULL column with a constant default (Postgres 11+ changes only the
catalog), and an index built ``CONCURRENTLY`` after it (conductor/migrations/online.py). Code before this
revision neither reads nor writes the column, and claims without the cap.

Revision ID: 0028_webhook_tenant_fairness
Revises: 0027_rollup_cache_writes
Create Date: 2026-11-29
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

from conductor.migrations import online

revision = "0028_webhook_tenant_fairness"
down_revision = "0027_rollup_cache_writes"
branch_labels = None
depends_on = None

PENDING_SQL = "status = 'pending'"
"""conductor.store.models.PENDING_DELIVERY_SQL as of this revision."""


def upgrade() -> None:
    with op.batch_alter_table("webhook_delivery") as batch:
        batch.add_column(sa.Column("deferrals", sa.Integer(), nullable=False, server_default="0"))
    with online.outside_transaction():
        online.create_index("ix_webhook_delivery_pending_tenant", "webhook_delivery",
                            ["tenant", "lease_expires_at", "next_attempt_at"], where=PENDING_SQL)


def downgrade() -> None:
    op.drop_index("ix_webhook_delivery_pending_tenant", table_name="webhook_delivery")
    with op.batch_alter_table("webhook_delivery") as batch:
        batch.drop_column("deferrals")
