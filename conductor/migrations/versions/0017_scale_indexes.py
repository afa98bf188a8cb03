"""indexes for the reads that walked a whole tenant, batch or backlog at scale (1.66M jobs, 5.6M steps):
a batch's counts by job status (replacing the index on job.batch_id alone, a prefix of it); a tenant's
top-level jobs of one status, newest first; job metadata (GIN, Postgres only: ``?`` and ``@>``); the
queued jobs the reconciler re-sends, by when their plan was sent (a partial index); a tenant's batches and
files, newest first

On Postgres each index is built CONCURRENTLY, outside the migration's transaction (autocommit), so a
live database keeps taking writes while it is built; an index left invalid by an interrupted build is
dropped and built again when the migration is re-run. SQLite (embedded mode) builds them plainly.

Revision ID: 0017_scale_indexes
Revises: 0016_webhook_url_from_default
Create Date: 2026-11-26
"""

from __future__ import annotations

from typing import Any, NamedTuple

from conductor.migrations import online

revision = "0017_scale_indexes"
down_revision = "0016_webhook_url_from_default"
branch_labels = None
depends_on = None


class Ix(NamedTuple):
    name: str
    table: str
    columns: list[str]
    where: str | None = None
    """A partial index's predicate, as SQL with literals (a bound parameter could not match it)."""
    options: dict[str, Any] | None = None
    postgres_only: bool = False


INDEXES = [
    Ix("ix_job_batch_status", "job", ["batch_id", "status"]),
    Ix("ix_job_tenant_status_created", "job", ["tenant", "status", "created_at", "id"],
       where="parent_job_id IS NULL"),
    Ix("ix_job_metadata", "job", ["metadata"], options={"postgresql_using": "gin"}, postgres_only=True),
    Ix("ix_job_queued", "job", ["enqueued_at", "created_at"], where="status = 'queued'"),
    Ix("ix_batch_tenant_created_id", "batch", ["tenant", "created_at", "id"]),
    Ix("ix_stored_file_tenant_created_id", "stored_file", ["tenant", "created_at", "id"]),
]
REPLACED = [Ix("ix_job_batch_id", "job", ["batch_id"])]
"""Prefixes of the new indexes: every read they served is served as well by the longer one."""


def _create(ix: Ix) -> None:
    online.create_index(ix.name, ix.table, ix.columns, where=ix.where, postgres_only=ix.postgres_only,
                        **(ix.options or {}))


def _drop(ix: Ix) -> None:
    online.drop_index(ix.name, ix.table, postgres_only=ix.postgres_only)


def upgrade() -> None:
    with online.outside_transaction():
        for ix in INDEXES:
            _create(ix)
        for ix in REPLACED:
            _drop(ix)


def downgrade() -> None:
    with online.outside_transaction():
        for ix in REPLACED:
            _create(ix)
        for ix in INDEXES:
            _drop(ix)
