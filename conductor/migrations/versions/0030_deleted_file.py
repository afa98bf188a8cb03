"""deleted_file: where each deleted file stood in its tenant's list, kept 7 days, so that a list paged with
a deleted file's id as its cursor (a client deleting files while it pages through them, as the openai SDK's
auto-paging does) goes on from there instead of answering an empty last page.

Additive: a new table, written by ``DELETE /v1/files/{id}`` of this revision's code and read by its
listing; code before it neither reads nor writes it.

Revision ID: 0030_deleted_file
Revises: 0029_webhook_parked
Create Date: 2026-11-29
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0030_deleted_file"
down_revision = "0029_webhook_parked"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "deleted_file",
        sa.Column("id", sa.String(64), primary_key=True),
        sa.Column("tenant", sa.String(128), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("deleted_at", sa.DateTime(timezone=True), nullable=False),
    )
    op.create_index("ix_deleted_file_deleted_at", "deleted_file", ["deleted_at"])


def downgrade() -> None:
    op.drop_index("ix_deleted_file_deleted_at", table_name="deleted_file")
    op.drop_table("deleted_file")
