"""job.webhook_url_from_default for the jobs stored before 0016 added it: true where the job's webhook URL is
its tenant's default URL at this upgrade, so replaying such a job sends to the default as it is then. A best
guess (docs/api.md): the request that named a URL equal to the default cannot be told apart.

Only jobs older than the first job 0016's code marked are guessed at: from then on the flag was written at
submit (a job left unmarked then named its URL itself). On Postgres the jobs are updated 10,000 ids at a
time, each batch committed alone (autocommit), so no long transaction holds their rows; a run cut short is
simply run again (updated jobs are no longer NULL).

Revision ID: 0018_backfill_url_from_default
Revises: 0017_scale_indexes
Create Date: 2026-11-26
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0018_backfill_url_from_default"
down_revision = "0017_scale_indexes"
branch_labels = None
depends_on = None

BATCH = 10_000
GUESS = (
    "job.webhook_url_from_default IS NULL AND job.webhook_url IS NOT NULL AND EXISTS (SELECT 1 FROM "
    "tenant_settings t WHERE t.tenant = job.tenant AND t.webhook_url = job.webhook_url)"
)
FIRST_MARKED = "SELECT min(created_at) FROM job WHERE webhook_url_from_default"


def upgrade() -> None:
    if op.get_bind().dialect.name != "postgresql":
        op.execute(f"UPDATE job SET webhook_url_from_default = 1 WHERE {GUESS} AND (NOT EXISTS (SELECT 1 FROM "
                   f"job marked WHERE marked.webhook_url_from_default) OR job.created_at < ({FIRST_MARKED}))")
        return
    with op.get_context().autocommit_block():
        bind = op.get_bind()
        before = bind.execute(sa.text(FIRST_MARKED)).scalar()
        older = "" if before is None else " AND job.created_at < :before"
        low = ""
        while True:
            high = bind.execute(sa.text("SELECT id FROM job WHERE id > :low ORDER BY id OFFSET :n LIMIT 1"),
                                {"low": low, "n": BATCH - 1}).scalar()
            last = "" if high is None else " AND job.id <= :high"
            bind.execute(sa.text(f"UPDATE job SET webhook_url_from_default = true WHERE job.id > :low{last} "
                                 f"AND {GUESS}{older}"), {"low": low, "high": high, "before": before})
            if high is None:
                return
            low = high


def downgrade() -> None:
    """Nothing to undo: a guessed true cannot be told from one written at submit (0016's downgrade drops
    the column)."""
