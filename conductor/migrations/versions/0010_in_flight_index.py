"""a partial index on unfinished top-level jobs per tenant: the in-flight quota's count, taken under the
tenant's lock on every submit, no longer scans the tenant's whole history

Revision ID: 0010_in_flight_index
Revises: 0009_webhooks
Create Date: 2026-11-23
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0010_in_flight_index"
down_revision = "0009_webhooks"
branch_labels = None
depends_on = None

IN_FLIGHT_SQL = "parent_job_id IS NULL AND status IN ('queued', 'planning', 'running')"


def upgrade() -> None:
    op.create_index("ix_job_tenant_in_flight", "job", ["tenant"], postgresql_where=sa.text(IN_FLIGHT_SQL),
                    sqlite_where=sa.text(IN_FLIGHT_SQL))


def downgrade() -> None:
    op.drop_index("ix_job_tenant_in_flight", table_name="job")
