"""webhooks: tenant_settings (default URL, signing secret), webhook_endpoint (disabled by 410),
webhook_delivery (the outbox, one per ended job) and webhook_attempt (every attempt)

Revision ID: 0009_webhooks
Revises: 0008_error_types
Create Date: 2026-11-23
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0009_webhooks"
down_revision = "0008_error_types"
branch_labels = None
depends_on = None


def _ts(name: str, nullable: bool = True) -> sa.Column:
    return sa.Column(name, sa.DateTime(timezone=True), nullable=nullable)


def upgrade() -> None:
    op.create_table(
        "tenant_settings",
        sa.Column("tenant", sa.String(128), primary_key=True),
        sa.Column("webhook_url", sa.String(2048), nullable=True),
        sa.Column("webhook_secret", sa.String(128), nullable=True),
        _ts("secret_created_at"),
        _ts("updated_at"),
    )
    op.create_table(
        "webhook_endpoint",
        sa.Column("tenant", sa.String(128), primary_key=True),
        sa.Column("url_hash", sa.String(64), primary_key=True),
        sa.Column("url", sa.String(2048), nullable=False),
        _ts("disabled_at"),
        sa.Column("disabled_reason", sa.Text(), nullable=True),
    )
    op.create_table(
        "webhook_delivery",
        sa.Column("id", sa.String(40), primary_key=True),
        sa.Column("job_id", sa.String(32), sa.ForeignKey("job.id"), nullable=False, unique=True),
        sa.Column("tenant", sa.String(128), nullable=False, index=True),
        sa.Column("url", sa.String(2048), nullable=False),
        sa.Column("event_type", sa.String(32), nullable=False),
        sa.Column("payload", sa.Text(), nullable=True),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("attempts", sa.Integer(), nullable=False, server_default="0"),
        _ts("next_attempt_at", nullable=False),
        _ts("lease_expires_at"),
        _ts("sent_at"),
        sa.Column("resends", sa.Integer(), nullable=False, server_default="0"),
        _ts("created_at"),
        _ts("finished_at"),
    )
    op.create_index("ix_webhook_delivery_status_next", "webhook_delivery", ["status", "next_attempt_at"])
    op.create_table(
        "webhook_attempt",
        sa.Column("id", sa.Integer(), primary_key=True, autoincrement=True),
        sa.Column("delivery_id", sa.String(40), sa.ForeignKey("webhook_delivery.id"), nullable=False, index=True),
        sa.Column("n", sa.Integer(), nullable=False),
        _ts("started_at"),
        _ts("finished_at"),
        sa.Column("status_code", sa.Integer(), nullable=True),
        sa.Column("latency_ms", sa.Integer(), nullable=True),
        sa.Column("error", sa.Text(), nullable=True),
        sa.UniqueConstraint("delivery_id", "n", name="uq_webhook_attempt_delivery_n"),
    )


def downgrade() -> None:
    op.drop_table("webhook_attempt")
    op.drop_index("ix_webhook_delivery_status_next", table_name="webhook_delivery")
    op.drop_table("webhook_delivery")
    op.drop_table("webhook_endpoint")
    op.drop_table("tenant_settings")
