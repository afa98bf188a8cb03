"""webhook_delivery.parked_at and a partial index on the parked deliveries by tenant and age: a delivery put
off for its tenant's cap of attempts in flight (0028) waits in the tenant's line, and the next of the
tenant's attempts to end wakes the oldest one, instead of every one coming back on a timer.

Additive, for a rolling deploy: a nullable column (the catalog only), then an index built ``CONCURRENTLY``
(conductor/migrations/online.py). Code before this revision neither reads nor writes the column: its claims
put deliveries off on a timer, which this revision's code also keeps as a fallback.

Revision ID: 0029_webhook_parked
Revises: 0028_webhook_tenant_fairness
Create Date: 2026-11-29
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

from conductor.migrations import online

revision = "0029_webhook_parked"
down_revision = "0028_webhook_tenant_fairness"
branch_labels = None
depends_on = None

PARKED_SQL = "status = 'pending' AND parked_at IS NOT NULL"
"""conductor.store.models.PARKED_DELIVERY_SQL as of this revision."""


def upgrade() -> None:
    with op.batch_alter_table("webhook_delivery") as batch:
        batch.add_column(sa.Column("parked_at", sa.DateTime(timezone=True), nullable=True))
    with online.outside_transaction():
        online.create_index("ix_webhook_delivery_parked", "webhook_delivery", ["tenant", "created_at"],
                            where=PARKED_SQL)


def downgrade() -> None:
    op.drop_index("ix_webhook_delivery_parked", table_name="webhook_delivery")
    with op.batch_alter_table("webhook_delivery") as batch:
        batch.drop_column("parked_at")
