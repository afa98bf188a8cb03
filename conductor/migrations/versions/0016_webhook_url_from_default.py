"""job.webhook_url_from_default: true when a job's webhook URL was its tenant's default (it named none), so
a replay sends to the tenant's default as it is then (changed or cleared since), not to the old one

Revision ID: 0016_webhook_url_from_default
Revises: 0015_previous_webhook_secret
Create Date: 2026-11-25
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0016_webhook_url_from_default"
down_revision = "0015_previous_webhook_secret"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("job") as batch:
        batch.add_column(sa.Column("webhook_url_from_default", sa.Boolean(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("job") as batch:
        batch.drop_column("webhook_url_from_default")
