"""ui_session: the trace viewer's browser sessions (a keyed hash of a random token per sign-in), so the
viewer's cookie no longer holds the API key itself

Revision ID: 0013_ui_session
Revises: 0012_step_resent_at
Create Date: 2026-11-24
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0013_ui_session"
down_revision = "0012_step_resent_at"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "ui_session",
        sa.Column("token_hash", sa.String(64), primary_key=True),
        sa.Column("key_id", sa.String(32), nullable=False),
        sa.Column("tenant", sa.String(128), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("expires_at", sa.DateTime(timezone=True), nullable=False),
    )
    op.create_index("ix_ui_session_key_id", "ui_session", ["key_id"])


def downgrade() -> None:
    op.drop_index("ix_ui_session_key_id", table_name="ui_session")
    op.drop_table("ui_session")
