"""metrics_rollup.cache_write_tokens: the folded jobs' and steps' cache writes (migration 0026), so
``/metrics`` counts them (``conductor_cache_write_tokens_total``) after a job is rolled up as before.

Additive, for a rolling deploy: a NOT NULL column with a constant default (Postgres 11+ changes only the
catalog), under ACCESS EXCLUSIVE on ``metrics_rollup`` for that instant. Code before this revision names the
columns it upserts and adds no cache writes: a reconciler of the release before that folds a job whose rows
a new worker wrote them to drops them from ``/metrics`` (the counter falls, a reset to Prometheus). Upgrade
``conductor beat`` before the workers (docs/architecture.md, Schema migrations).

Revision ID: 0027_rollup_cache_writes
Revises: 0026_cache_writes
Create Date: 2026-11-28
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0027_rollup_cache_writes"
down_revision = "0026_cache_writes"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("metrics_rollup") as batch:
        batch.add_column(sa.Column("cache_write_tokens", sa.BigInteger(), nullable=False, server_default="0"))


def downgrade() -> None:
    with op.batch_alter_table("metrics_rollup") as batch:
        batch.drop_column("cache_write_tokens")
