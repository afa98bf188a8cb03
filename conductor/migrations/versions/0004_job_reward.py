"""job.reward: the GRPO reward of an evaluated job (0 unparseable workflow, 0.5 valid but wrong, 1 correct)

Revision ID: 0004_job_reward
Revises: 0003
Create Date: 2026-11-23
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0004_job_reward"
down_revision = "0003"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("job") as batch:
        batch.add_column(sa.Column("reward", sa.Float(), nullable=True))
        batch.add_column(sa.Column("eval_run", sa.String(length=64), nullable=True))
        batch.create_index("ix_job_eval_run", ["eval_run"])


def downgrade() -> None:
    with op.batch_alter_table("job") as batch:
        batch.drop_index("ix_job_eval_run")
        batch.drop_column("eval_run")
        batch.drop_column("reward")
