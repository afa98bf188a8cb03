"""Cache writes: of a step's (and a job's) input tokens, those written to the provider's prompt cache
(Anthropic's cache writes, which the Anthropic agents cause since they mark shared prompt prefixes).
``step.cache_write_tokens``, the job's planner column and total alike.

Additive, for a rolling deploy: NOT NULL columns with a constant default (Postgres 11+ changes only the
catalog; no rewrite), each table under ACCESS EXCLUSIVE for that instant. Code before this revision names
the columns it inserts and adds to, so its rows read back with no cache writes: what it knew.

Revision ID: 0026_cache_writes
Revises: 0025_batch_usage
Create Date: 2026-11-28
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0026_cache_writes"
down_revision = "0025_batch_usage"
branch_labels = None
depends_on = None

STEP = ("cache_write_tokens",)
JOB = ("planner_cache_write_tokens", "cache_write_tokens")


def upgrade() -> None:
    with op.batch_alter_table("step") as batch:
        for name in STEP:
            batch.add_column(sa.Column(name, sa.Integer(), nullable=False, server_default="0"))
    with op.batch_alter_table("job") as batch:
        for name in JOB:
            batch.add_column(sa.Column(name, sa.Integer(), nullable=False, server_default="0"))


def downgrade() -> None:
    with op.batch_alter_table("job") as batch:
        for name in reversed(JOB):
            batch.drop_column(name)
    with op.batch_alter_table("step") as batch:
        for name in reversed(STEP):
            batch.drop_column(name)
