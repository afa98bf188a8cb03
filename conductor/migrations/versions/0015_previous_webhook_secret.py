"""tenant_settings.previous_webhook_secret and previous_secret_expires_at: after a rotation the previous
signing secret signs too (a second ``v1,`` signature) until it expires, so receivers can switch without
rejecting deliveries

Revision ID: 0015_previous_webhook_secret
Revises: 0014_sealed_webhook_secret
Create Date: 2026-11-25
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0015_previous_webhook_secret"
down_revision = "0014_sealed_webhook_secret"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("tenant_settings") as batch:
        batch.add_column(sa.Column("previous_webhook_secret", sa.String(512), nullable=True))
        batch.add_column(sa.Column("previous_secret_expires_at", sa.DateTime(timezone=True), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("tenant_settings") as batch:
        batch.drop_column("previous_secret_expires_at")
        batch.drop_column("previous_webhook_secret")
