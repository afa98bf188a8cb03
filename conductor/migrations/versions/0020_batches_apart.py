"""a batch's lines leave the tenant's jobs-in-flight count: ``tenant_in_flight`` and its triggers count
unfinished top-level jobs with no ``batch_id`` (conductor.store.models.LIVE_IN_FLIGHT_SQL)

A batch of 1,000 lines (the default ``CONDUCTOR_BATCH_MAX_LINES``) put a tenant with the default limit of 200
jobs in flight 800 past it: every live submission of that tenant was refused (429) until the batch had
nearly ended, for hours. Batches are bounded by their own quota now (``CONDUCTOR_TENANT_MAX_BATCH_JOBS_IN_FLIGHT``).
The counts are taken again under an ACCESS EXCLUSIVE lock on ``job`` (reads and writes of ``job`` wait for
the count: one pass over the partial index of unfinished top-level jobs; DROP TRIGGER takes that lock anyway).
SQLite counts with the query and needs nothing.

Revision ID: 0020_batches_apart
Revises: 0019_metrics_rollup
Create Date: 2026-11-25
"""

from __future__ import annotations

from alembic import op

revision = "0020_batches_apart"
down_revision = "0019_metrics_rollup"
branch_labels = None
depends_on = None


def _in_flight(row: str, batches: bool) -> str:
    """The unfinished top-level jobs (with a batch's lines, as 0011 counted, or without) of ``row``."""
    lines = "" if batches else f" AND {row}.batch_id IS NULL"
    return f"({row}.parent_job_id IS NULL AND {row}.status IN ('queued', 'planning', 'running'){lines})"


def _count(batches: bool) -> None:
    """The triggers' function and triggers for this definition, and every tenant's row counted again."""
    old, new = _in_flight("OLD", batches), _in_flight("NEW", batches)
    # no job changes between the count and the triggers. ACCESS EXCLUSIVE from the start, the level DROP TRIGGER
    # takes anyway: holding a weaker lock (0011's SHARE ROW EXCLUSIVE) while asking for it deadlocked with a
    # transaction that had locked a job row (ROW SHARE) and then wrote job (ROW EXCLUSIVE), a step outcome
    op.execute("LOCK TABLE job IN ACCESS EXCLUSIVE MODE")
    for trigger in ("insert", "delete", "update"):
        op.execute(f"DROP TRIGGER job_in_flight_{trigger} ON job")
    op.execute(f"""
        CREATE OR REPLACE FUNCTION conductor_tenant_in_flight() RETURNS trigger LANGUAGE plpgsql AS $$
        BEGIN
          IF TG_OP <> 'INSERT' AND {old} THEN
            UPDATE tenant_in_flight SET jobs = jobs - 1 WHERE tenant = OLD.tenant;
          END IF;
          IF TG_OP <> 'DELETE' AND {new} THEN
            INSERT INTO tenant_in_flight AS t (tenant, jobs) VALUES (NEW.tenant, 1)
            ON CONFLICT (tenant) DO UPDATE SET jobs = t.jobs + 1;
          END IF;
          RETURN NULL;
        END $$""")
    op.execute(f"CREATE TRIGGER job_in_flight_insert AFTER INSERT ON job FOR EACH ROW WHEN {new} "
               "EXECUTE FUNCTION conductor_tenant_in_flight()")
    op.execute(f"CREATE TRIGGER job_in_flight_delete AFTER DELETE ON job FOR EACH ROW WHEN {old} "
               "EXECUTE FUNCTION conductor_tenant_in_flight()")
    # batch_id is set at the insert and never changes: the update trigger watches the same columns as 0011's
    op.execute(f"CREATE TRIGGER job_in_flight_update AFTER UPDATE OF status, parent_job_id, tenant ON job "
               f"FOR EACH ROW WHEN ({old} IS DISTINCT FROM {new} OR OLD.tenant <> NEW.tenant) "
               "EXECUTE FUNCTION conductor_tenant_in_flight()")
    op.execute("DELETE FROM tenant_in_flight")
    op.execute(f"INSERT INTO tenant_in_flight (tenant, jobs) SELECT tenant, count(*) FROM job "
               f"WHERE {_in_flight('job', batches)} GROUP BY tenant")


def upgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        _count(batches=False)


def downgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        _count(batches=True)
