"""openai_response.previous_response_id: the response a response continues (``previous_response_id`` of
``POST /v1/responses``), echoed on every read of it.

Additive, for a rolling deploy: a nullable column without a default (Postgres changes only the catalog;
no rewrite), under ACCESS EXCLUSIVE on ``openai_response`` for that instant; ``job`` is not touched (no
foreign key: creating one would take SHARE ROW EXCLUSIVE on ``job``, and a response's job is never deleted
anyway). The code before this revision inserts its rows naming their columns, so its rows read back with
no previous response, which is what they had.

Revision ID: 0022_response_chains
Revises: 0021_openai_responses
Create Date: 2026-11-25
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0022_response_chains"
down_revision = "0021_openai_responses"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("openai_response") as batch:
        batch.add_column(sa.Column("previous_response_id", sa.String(64), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("openai_response") as batch:
        batch.drop_column("previous_response_id")
