"""openai_response: the jobs created through OpenAI's Responses API (``POST /v1/responses``), with what that
API echoes and a job does not hold (the model as named, ``background``, whether ``instructions`` lead the
job's context). One row per such job, its id the job's; no other table changes.

Creating its foreign key takes SHARE ROW EXCLUSIVE on ``job`` for an instant (writes to ``job`` wait; reads
do not), under ``CONDUCTOR_MIGRATION_LOCK_TIMEOUT_S`` like every statement of a revision.

Revision ID: 0021_openai_responses
Revises: 0020_batches_apart
Create Date: 2026-11-25
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0021_openai_responses"
down_revision = "0020_batches_apart"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "openai_response",
        sa.Column("job_id", sa.String(), sa.ForeignKey("job.id"), primary_key=True),
        sa.Column("model", sa.String(256), nullable=False),
        sa.Column("background", sa.Boolean(), nullable=False),
        sa.Column("instructions", sa.Boolean(), nullable=False),
    )


def downgrade() -> None:
    op.drop_table("openai_response")
