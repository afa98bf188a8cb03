"""job.replay_*, step.reused_from: replays link to their original; an index for paging GET /v1/jobs

Revision ID: 0007_replay
Revises: 0006_budget_reservations
Create Date: 2026-11-23
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision = "0007_replay"
down_revision = "0006_budget_reservations"
branch_labels = None
depends_on = None


def upgrade() -> None:
    json_type = sa.JSON().with_variant(postgresql.JSONB(), "postgresql")
    with op.batch_alter_table("job") as batch:
        batch.add_column(sa.Column("replay_of", sa.String(), nullable=True))
        batch.add_column(sa.Column("replay_from_step", sa.Integer(), nullable=True))
        batch.add_column(sa.Column("replay_agents", json_type, nullable=True))
        batch.add_column(sa.Column("replay_replan", sa.Boolean(), nullable=False, server_default=sa.false()))
        batch.create_foreign_key("fk_job_replay_of_job", "job", ["replay_of"], ["id"])
        batch.create_index("ix_job_replay_of", ["replay_of"])
        batch.create_index("ix_job_tenant_created_id", ["tenant", "created_at", "id"])
    with op.batch_alter_table("step") as batch:
        batch.add_column(sa.Column("reused_from", sa.Integer(), nullable=True))
        batch.create_foreign_key("fk_step_reused_from_step", "step", ["reused_from"], ["id"])


def downgrade() -> None:
    with op.batch_alter_table("step") as batch:
        batch.drop_constraint("fk_step_reused_from_step", type_="foreignkey")
        batch.drop_column("reused_from")
    with op.batch_alter_table("job") as batch:
        batch.drop_index("ix_job_tenant_created_id")
        batch.drop_index("ix_job_replay_of")
        batch.drop_constraint("fk_job_replay_of_job", type_="foreignkey")
        batch.drop_column("replay_replan")
        batch.drop_column("replay_agents")
        batch.drop_column("replay_from_step")
        batch.drop_column("replay_of")
