"""What one job's writes cost the database at the schema it is at: the INSERT of a submission and the three
status changes of its life (planning, running, succeeded), each run under EXPLAIN (ANALYZE, WAL, BUFFERS):
WAL records and bytes, shared buffers touched and execution time, medians over ``--jobs`` new jobs. WAL
and buffers count what the indexes cost, whatever else the machine is doing; the times are noisy on a busy
machine. Writes ``--jobs`` rows (committed) into the database given, which must hold at least one top-level
job to copy (e.g. after ``python -m bench api --quick`` or ``bench/scale_fill.sql``). A before/after of a
migration on one scratch database (docs/benchmarks.md, "What the job's indexes cost a write"):

    python bench/job_writes.py postgresql://postgres@127.0.0.1/conductor_bench --at 0016_webhook_url_from_default
    python bench/job_writes.py postgresql://postgres@127.0.0.1/conductor_bench --at head
"""

from __future__ import annotations

import argparse
import json
import statistics
import uuid

import psycopg

STAGES = {
    "insert": None,
    "to planning": "UPDATE job SET status = 'planning', updated_at = now() WHERE id = %s",
    "to running": "UPDATE job SET status = 'running', started_at = now(), updated_at = now() WHERE id = %s",
    "to succeeded": "UPDATE job SET status = 'succeeded', finished_at = now(), updated_at = now() WHERE id = %s",
}
METADATA = '{"team": "search", "run": "42"}'
"""The copied job's metadata (a GIN index holds one entry per key and value)."""


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("url", help="a scratch database (rows are added)")
    p.add_argument("--jobs", type=int, default=300)
    p.add_argument("--at", help="migrate (up or down) to this revision first, e.g. head")
    args = p.parse_args()
    if args.at:
        migrate(args.url, args.at)
    with psycopg.connect(args.url, autocommit=True) as conn:
        print(json.dumps(measure(conn, args.jobs)))
    return 0


def migrate(url: str, revision: str) -> None:
    from alembic import command
    from alembic.script import ScriptDirectory

    from conductor.migrations.migrate import alembic_config, schema_revisions, upgrade

    sa_url = url.replace("postgresql://", "postgresql+psycopg://", 1)
    current, heads, _ = schema_revisions(sa_url)
    config = alembic_config(sa_url)
    target = next(iter(heads)) if revision == "head" else revision
    ancestors = {s.revision for s in ScriptDirectory.from_config(config).iterate_revisions(target, "base")}
    if current <= ancestors and current != {target}:
        upgrade(sa_url, target)
    elif current != {target}:
        command.downgrade(config, target)


def measure(conn: psycopg.Connection, jobs: int) -> dict[str, object]:
    columns = [r[0] for r in conn.execute(
        "SELECT column_name FROM information_schema.columns WHERE table_name = 'job' ORDER BY ordinal_position")]
    row = conn.execute("SELECT id FROM job WHERE parent_job_id IS NULL ORDER BY created_at LIMIT 1").fetchone()
    if row is None:
        raise SystemExit("no job to copy in this database: run python -m bench api --quick against it first")
    template = row[0]
    conn.execute("UPDATE job SET metadata = %s::json WHERE id = %s", (METADATA, template))
    fresh = {"id": "%s", "idempotency_key": "NULL", "status": "'queued'", "created_at": "now()",
             "updated_at": "now()", "started_at": "NULL", "finished_at": "NULL"}
    insert = (f"INSERT INTO job ({', '.join(f'{chr(34)}{c}{chr(34)}' for c in columns)}) "
              f"SELECT {', '.join(fresh.get(c, f'{chr(34)}{c}{chr(34)}') for c in columns)} FROM job WHERE id = %s")
    seen: dict[str, dict[str, list[float]]] = {s: {"wal_records": [], "wal_bytes": [], "buffers": [], "ms": []}
                                              for s in STAGES}
    for _ in range(jobs):
        job_id = uuid.uuid4().hex[:26]
        with conn.transaction():
            for stage, sql in STAGES.items():
                statement, params = (insert, (job_id, template)) if sql is None else (sql, (job_id,))
                explained = conn.execute("EXPLAIN (ANALYZE, WAL, BUFFERS, FORMAT JSON) " + statement, params)
                plan = explained.fetchone()[0][0]  # type: ignore[index]
                top = plan["Plan"]
                seen[stage]["wal_records"].append(top.get("WAL Records", 0))
                seen[stage]["wal_bytes"].append(top.get("WAL Bytes", 0))
                seen[stage]["buffers"].append(sum(top.get(k, 0) for k in (
                    "Shared Hit Blocks", "Shared Read Blocks", "Shared Dirtied Blocks")))
                seen[stage]["ms"].append(plan["Execution Time"])
    indexes = conn.execute("SELECT count(*) FROM pg_indexes WHERE tablename = 'job'").fetchone()
    rows = conn.execute("SELECT count(*) FROM job").fetchone()
    medians = {stage: {k: round(statistics.median(v), 3) for k, v in m.items()} for stage, m in seen.items()}
    total = {k: round(sum(medians[s][k] for s in STAGES), 3) for k in ("wal_records", "wal_bytes", "buffers", "ms")}
    return {"indexes": indexes[0] if indexes else 0, "rows": rows[0] if rows else 0, **medians, "job": total}


if __name__ == "__main__":
    raise SystemExit(main())
