"""tenant_settings.webhook_secret widened to 512 characters: a secret sealed with CONDUCTOR_SECRETS_KEY
(``fernet:`` and a Fernet token) takes about 170

Revision ID: 0014_sealed_webhook_secret
Revises: 0013_ui_session
Create Date: 2026-11-24
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0014_sealed_webhook_secret"
down_revision = "0013_ui_session"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("tenant_settings") as batch:
        batch.alter_column("webhook_secret", type_=sa.String(512), existing_type=sa.String(128),
                           existing_nullable=True)


def downgrade() -> None:
    # Postgres refuses while a sealed secret (longer than 128) is stored: re-create those tenants' secrets
    # without CONDUCTOR_SECRETS_KEY (conductor webhooks secret --rotate) before going back.
    with op.batch_alter_table("tenant_settings") as batch:
        batch.alter_column("webhook_secret", type_=sa.String(128), existing_type=sa.String(512),
                           existing_nullable=True)
