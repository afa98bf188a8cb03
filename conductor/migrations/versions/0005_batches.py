"""OpenAI-compatible Files and Batches: stored_file, batch, batch_request; job.batch_id

Revision ID: 0005_batches
Revises: 0004_job_reward
Create Date: 2026-11-23
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision = "0005_batches"
down_revision = "0004_job_reward"
branch_labels = None
depends_on = None

JSON = sa.JSON().with_variant(postgresql.JSONB(astext_type=sa.Text()), "postgresql")


def upgrade() -> None:
    op.create_table(
        "stored_file",
        sa.Column("id", sa.String(length=64), primary_key=True),
        sa.Column("tenant", sa.String(length=128), nullable=False),
        sa.Column("purpose", sa.String(length=32), nullable=False),
        sa.Column("filename", sa.String(length=255), nullable=False),
        sa.Column("size_bytes", sa.Integer(), nullable=False),
        sa.Column("lines", sa.Integer(), nullable=False),
        sa.Column("content", sa.LargeBinary(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=True),
    )
    op.create_index("ix_stored_file_tenant", "stored_file", ["tenant"])
    op.create_table(
        "batch",
        sa.Column("id", sa.String(length=64), primary_key=True),
        sa.Column("tenant", sa.String(length=128), nullable=False),
        sa.Column("status", sa.String(length=16), nullable=False),
        sa.Column("endpoint", sa.String(length=64), nullable=False),
        sa.Column("input_file_id", sa.String(length=64), nullable=False),
        sa.Column("completion_window", sa.String(length=16), nullable=False),
        sa.Column("metadata", JSON, nullable=True),
        sa.Column("total", sa.Integer(), nullable=False),
        sa.Column("output_file_id", sa.String(length=64), nullable=True),
        sa.Column("error_file_id", sa.String(length=64), nullable=True),
        *(sa.Column(name, sa.DateTime(timezone=True), nullable=True) for name in (
            "created_at", "in_progress_at", "expires_at", "finalizing_at", "completed_at", "expired_at",
            "cancelling_at", "cancelled_at")),
    )
    op.create_index("ix_batch_tenant", "batch", ["tenant"])
    op.create_index("ix_batch_status", "batch", ["status"])
    op.create_table(
        "batch_request",
        sa.Column("id", sa.Integer(), primary_key=True, autoincrement=True),
        sa.Column("batch_id", sa.String(length=64), sa.ForeignKey("batch.id"), nullable=False),
        sa.Column("line", sa.Integer(), nullable=False),
        sa.Column("custom_id", sa.String(length=512), nullable=False),
        sa.Column("job_id", sa.String(), sa.ForeignKey("job.id"), nullable=True),
        sa.Column("error_code", sa.String(length=64), nullable=True),
        sa.Column("error", sa.Text(), nullable=True),
        sa.UniqueConstraint("batch_id", "line", name="uq_batch_request_line"),
        sa.UniqueConstraint("batch_id", "custom_id", name="uq_batch_request_custom_id"),
    )
    op.create_index("ix_batch_request_batch_id", "batch_request", ["batch_id"])
    op.create_index("ix_batch_request_job_id", "batch_request", ["job_id"])
    with op.batch_alter_table("job") as batch:
        batch.add_column(sa.Column("batch_id", sa.String(length=64), nullable=True))
        batch.create_index("ix_job_batch_id", ["batch_id"])


def downgrade() -> None:
    with op.batch_alter_table("job") as batch:
        batch.drop_index("ix_job_batch_id")
        batch.drop_column("batch_id")
    op.drop_table("batch_request")
    op.drop_table("batch")
    op.drop_table("stored_file")
