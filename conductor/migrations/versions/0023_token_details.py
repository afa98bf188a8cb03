"""Token details: of a step's (and a job's) input tokens, those read from the provider's prompt cache; of its
output tokens, the model's reasoning. ``step.cached_input_tokens``, ``step.reasoning_tokens``, the job's
planner columns and totals alike.

Additive, for a rolling deploy: NOT NULL columns with a constant default (Postgres 11+ changes only the
catalog; no rewrite), each table under ACCESS EXCLUSIVE for that instant. Code before this revision names
the columns it inserts and adds to, so its rows read back with no cached or reasoning tokens: what it knew.

Revision ID: 0023_token_details
Revises: 0022_response_chains
Create Date: 2026-11-28
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0023_token_details"
down_revision = "0022_response_chains"
branch_labels = None
depends_on = None

STEP = ("cached_input_tokens", "reasoning_tokens")
JOB = ("planner_cached_input_tokens", "planner_reasoning_tokens", "cached_input_tokens", "reasoning_tokens")


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
