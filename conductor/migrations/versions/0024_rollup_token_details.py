"""metrics_rollup.cached_input_tokens, metrics_rollup.reasoning_tokens: the folded jobs' and steps' token
details (migration 0023), so ``/metrics`` counts them after a job is rolled up as before.

Additive, for a rolling deploy: NOT NULL columns with a constant default (Postgres 11+ changes only the
catalog), under ACCESS EXCLUSIVE on ``metrics_rollup`` for that instant. Code before this revision names the
columns it upserts and adds no details: a reconciler of the release before that folds a job whose rows a new
worker wrote details to drops them from ``/metrics`` (the counters fall, a reset to Prometheus). Upgrade
``conductor beat`` before the workers (docs/architecture.md, Schema migrations).

Revision ID: 0024_rollup_token_details
Revises: 0023_token_details
Create Date: 2026-11-28
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0024_rollup_token_details"
down_revision = "0023_token_details"
branch_labels = None
depends_on = None

COLUMNS = ("cached_input_tokens", "reasoning_tokens")


def upgrade() -> None:
    with op.batch_alter_table("metrics_rollup") as batch:
        for name in COLUMNS:
            batch.add_column(sa.Column(name, sa.BigInteger(), nullable=False, server_default="0"))


def downgrade() -> None:
    with op.batch_alter_table("metrics_rollup") as batch:
        for name in reversed(COLUMNS):
            batch.drop_column(name)
