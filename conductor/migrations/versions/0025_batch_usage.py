"""batch.usage: the tokens of a batch's jobs, summed when the batch ends (the OpenAI batch object's ``usage``).

Additive, for a rolling deploy: a nullable column without a default (Postgres changes only the catalog), under
ACCESS EXCLUSIVE on ``batch`` for that instant. A batch ended before this revision, or by code before it,
reads back with no usage (``null``, as OpenAI's older batches have).

Revision ID: 0025_batch_usage
Revises: 0024_rollup_token_details
Create Date: 2026-11-28
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects.postgresql import JSONB

revision = "0025_batch_usage"
down_revision = "0024_rollup_token_details"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("batch") as batch:
        batch.add_column(sa.Column("usage", sa.JSON().with_variant(JSONB(), "postgresql"), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("batch") as batch:
        batch.drop_column("usage")
