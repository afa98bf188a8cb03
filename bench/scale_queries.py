"""EXPLAIN ANALYZE of the reads that grow with a tenant's history, on a database filled by
``bench/scale_fill.sql`` (docs/benchmarks.md, "Queries at scale"). The statements are the ones the store
functions of the checkout on ``PYTHONPATH`` send (captured, then explained with the same parameters), so
running it with two checkouts compares them:

    PYTHONPATH=/tmp/before python bench/scale_queries.py postgresql+psycopg://postgres@127.0.0.1/review_scale2
    PYTHONPATH=.           python bench/scale_queries.py postgresql+psycopg://postgres@127.0.0.1/review_scale2

Each case's time is the median over ``--repeat`` runs of its statements' summed execution time (server
side, warm cache; planning time beside it), with the indexes (or sequential scans) its plans use. Reads
only.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from collections.abc import Callable
from datetime import timedelta
from typing import Any


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("url")
    p.add_argument("--repeat", type=int, default=7)
    p.add_argument("--tenant", default="big")
    p.add_argument("--only", default="", help="run only the cases whose name contains this")
    args = p.parse_args()
    os.environ["CONDUCTOR_DATABASE_URL"] = args.url

    import sqlalchemy as sa

    from conductor import reconcile
    from conductor.store import batches, webhooks
    from conductor.store import jobs as store
    from conductor.store.db import get_engine, session_scope
    from conductor.store.models import Batch, Job, StoredFile

    tenant = args.tenant
    with session_scope() as s:
        batch_id = s.execute(sa.select(Batch.id).where(Batch.tenant == tenant, Batch.status == "in_progress")
                             .order_by(sa.desc(Batch.total)).limit(1)).scalar_one()
        page_of_batches = batches.list_batches(s, tenant=tenant, after=None, limit=151)
        batch_cursor = page_of_batches[-1].id
        file_cursor = s.execute(sa.select(StoredFile.id).where(StoredFile.tenant == tenant)
                                .order_by(sa.desc(StoredFile.created_at), sa.desc(StoredFile.id))
                                .offset(1000).limit(1)).scalar_one()
        cancelled = store.list_jobs(s, tenant=tenant, where=store.JobFilter(statuses=("cancelled",)), limit=51)
        run7 = store.list_jobs(s, tenant=tenant, where=store.JobFilter(meta_key="run", meta_value="7"), limit=51)
        s.expunge_all()
        # "now" is when the fill ran (its newest job), however long ago: the windows hold what they would
        now = s.execute(sa.select(sa.func.max(Job.created_at)).where(Job.tenant == tenant)).scalar_one()
    F = store.JobFilter
    cases: dict[str, Callable[[Any], Any]] = {
        "batch counts, 50k lines": lambda s: batches.batch_counts(s, batch_id=batch_id),
        "jobs, no filter": lambda s: store.list_jobs(s, tenant=tenant, limit=51),
        "jobs, status=cancelled": lambda s: store.list_jobs(s, tenant=tenant, where=F(statuses=("cancelled",)),
                                                            limit=51),
        "jobs, status=failed": lambda s: store.list_jobs(s, tenant=tenant, where=F(statuses=("failed",)), limit=51),
        "jobs, status=cancelled, page 2": lambda s: store.list_jobs(
            s, tenant=tenant, where=F(statuses=("cancelled",)), after=cancelled[-1], limit=51),
        "jobs, status=failed&cancelled": lambda s: store.list_jobs(
            s, tenant=tenant, where=F(statuses=("failed", "cancelled")), limit=51),
        "jobs, status=queued&running": lambda s: store.list_jobs(
            s, tenant=tenant, where=F(statuses=("queued", "running")), limit=51),
        "jobs, meta_key nobody has": lambda s: store.list_jobs(s, tenant=tenant, where=F(meta_key="nokey"),
                                                               limit=51),
        "jobs, meta_key=run&meta_value=7 (1 in 1,000)": lambda s: store.list_jobs(
            s, tenant=tenant, where=F(meta_key="run", meta_value="7"), limit=51),
        "jobs, meta_key=project&meta_value=p3 (1 in 50)": lambda s: store.list_jobs(
            s, tenant=tenant, where=F(meta_key="project", meta_value="p3"), limit=51),
        "jobs, meta_key=project&meta_value=p3, status=failed": lambda s: store.list_jobs(
            s, tenant=tenant, where=F(meta_key="project", meta_value="p3", statuses=("failed",)), limit=51),
        "jobs, meta_key=run&meta_value=7, page 2": lambda s: store.list_jobs(
            s, tenant=tenant, where=F(meta_key="run", meta_value="7"), after=run7[-1], limit=51),
        "jobs, meta_key=project (every job)": lambda s: store.list_jobs(s, tenant=tenant,
                                                                        where=F(meta_key="project"), limit=51),
        "jobs_stuck_queued (49k queued)": lambda s: store.jobs_stuck_queued(s, older_than=now - timedelta(seconds=30)),
        "jobs_never_enqueued": lambda s: store.jobs_never_enqueued(s, older_than=now - timedelta(seconds=2)),
        "batches, page after the 151st": lambda s: batches.list_batches(s, tenant=tenant, after=batch_cursor,
                                                                         limit=21),
        "files, page after the 1,001st": lambda s: batches.list_files(s, tenant=tenant, purpose=None,
                                                                       after=file_cursor, limit=21),
        f"webhook backfill, window {reconcile.WEBHOOK_BACKFILL_S:.0f} s": lambda s: (
            webhooks.ended_jobs_without_delivery(s, since=now - timedelta(seconds=reconcile.WEBHOOK_BACKFILL_S))),
    }
    engine = get_engine()
    results = []
    for name, call in cases.items():
        if args.only and args.only not in name:
            continue
        captured: list[tuple[str, Any]] = []

        def seen(_conn: Any, _cursor: Any, statement: str, parameters: Any, *_: Any) -> None:
            captured.append((statement, parameters))  # noqa: B023

        sa.event.listen(engine, "before_cursor_execute", seen)
        try:
            with session_scope() as s:
                call(s)
        finally:
            sa.event.remove(engine, "before_cursor_execute", seen)
        statements = [(st, params) for st, params in captured if st.lstrip().upper().startswith(("SELECT", "WITH"))]
        times: list[float] = []
        planning: list[float] = []
        indexes: set[str] = set()
        with engine.connect() as conn:
            cursor = conn.connection.driver_connection.cursor()  # type: ignore[union-attr]
            for _ in range(args.repeat):
                total = planned = 0.0
                for st, params in statements:
                    cursor.execute("EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) " + st, params)
                    plan = cursor.fetchone()[0][0]
                    total += plan["Execution Time"]
                    planned += plan["Planning Time"]
                    indexes |= set(_indexes(plan["Plan"]))
                times.append(total)
                planning.append(planned)
        ms, plan_ms = statistics.median(times), statistics.median(planning)
        results.append({"case": name, "execution_ms": round(ms, 2), "planning_ms": round(plan_ms, 2),
                        "statements": len(statements), "indexes": sorted(indexes)})
        print(f"| {name} | {ms:.2f} | {plan_ms:.2f} | {', '.join(sorted(indexes))} |", flush=True)
    json.dump(results, sys.stderr)
    return 0


def _indexes(node: dict[str, Any]) -> list[str]:
    found = [node["Index Name"]] if "Index Name" in node else []
    if "Index Name" not in node and node.get("Node Type") == "Seq Scan":
        found.append(f"seq scan {node.get('Relation Name')}")
    for child in node.get("Plans", []):
        found += _indexes(child)
    return found


if __name__ == "__main__":
    sys.exit(main())
