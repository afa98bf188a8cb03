"""``python -m bench.metrics_scale``: what a ``/metrics`` scrape costs on a database with a long history.

    python -m bench.metrics_scale fill --url URL --jobs 1000000      # rows made by generate_series
    python -m bench.metrics_scale scrape --url URL [--tenant T]      # read_aggregates, timed
    python -m bench.metrics_scale rollup --url URL                   # fold every settled job and delivery

``URL`` is a migrated database of its own (never the tests'): ``fill`` adds ``--jobs`` ended jobs spread
over ``--tenants`` tenants and 10 agents (plus ``--in-flight`` running ones, and jobs that ended a moment
ago), ``--steps`` steps per job with one attempt each (every 8th step a second, failed, one), and a webhook
delivery with two sends for every ``--delivery-every``-th job. ``scrape`` times whatever
``conductor.store.metrics.read_aggregates`` is imported (``--code DIR``: another checkout's, for the
before), and ``rollup`` folds as the reconciler does, timing each batch. Timings are printed, never
asserted (tests/integration/test_metrics_rollup.py uses ``fill`` at a small scale, ``EXPLAIN`` included).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Any

import sqlalchemy as sa

AGENTS = 10


def fill(conn: Any, *, jobs: int, steps: int = 4, tenants: int = 20, in_flight: int = 200, recent: int = 200,
         delivery_every: int = 2, rolled_up: bool = False, tenant_prefix: str = "tenant-") -> None:
    """Adds ``jobs`` jobs that ended (oldest first, one a second up to an hour ago), ``recent`` that ended
    just now and ``in_flight`` still running, with their steps, attempts and webhook deliveries. With
    ``rolled_up`` the ended ones are marked as folded (their sums are not added to the rollup: for
    ``EXPLAIN`` only)."""
    total = jobs + recent + in_flight
    run = conn.exec_driver_sql
    base = run("SELECT coalesce(max(substr(id, 6)::int), 0) FROM job WHERE id LIKE 'fill-%%'").scalar_one()
    params = {"base": base, "jobs": jobs, "recent": recent, "total": total, "tenants": tenants,
              "prefix": tenant_prefix}
    run(f"""
        INSERT INTO job (id, tenant, status, task, pool, pool_config, planner, depth, planner_attempts,
                         planner_input_tokens, planner_output_tokens, planner_cost_usd, planner_calls, input_tokens,
                         output_tokens, cost_usd, calls, limits, metadata, cancel_requested, created_at, updated_at,
                         started_at, planned_at, finished_at, plan_claims, plan_resends, replay_replan,
                         metrics_rolled_up_at)
        SELECT 'fill-' || lpad((%(base)s + i)::text, 10, '0'), %(prefix)s || (i %% %(tenants)s),
               CASE WHEN i > %(jobs)s + %(recent)s THEN 'running' WHEN i %% 50 = 0 THEN 'failed'
                    WHEN i %% 97 = 0 THEN 'cancelled' ELSE 'succeeded' END,
               'a task of the scale fill', 'default', '{{}}', CASE WHEN i %% 3 = 0 THEN 'template:single' ELSE
               'conductor' END, 0, 1, 300 + i %% 200, 80 + i %% 50, 0.0003, 1, 0, 0, 0, 4, '{{}}', '{{}}', false,
               t.ended - interval '20 seconds', t.ended, t.ended - interval '20 seconds',
               t.ended - interval '15 seconds',
               CASE WHEN i > %(jobs)s + %(recent)s THEN NULL ELSE t.ended END,
               CASE WHEN i %% 1000 = 0 THEN 2 ELSE 1 END, CASE WHEN i %% 500 = 0 THEN 1 ELSE 0 END, false,
               CASE WHEN {'i <= %(jobs)s' if rolled_up else 'false'} THEN now() END
        FROM generate_series(1, %(total)s) AS i,
             LATERAL (SELECT CASE WHEN i <= %(jobs)s
                                  THEN now() - interval '1 hour' - (%(jobs)s - i) * interval '1 second'
                                  ELSE now() END AS ended) AS t
    """, params)
    run(f"""
        INSERT INTO step (job_id, index, agent, instruction, access_list, access_all, status, input_tokens,
                          output_tokens, cost_usd, latency_ms, attempts, resends, queued_at, started_at, finished_at)
        SELECT j.id, k, CASE WHEN (n + k) %% 40 = 0 THEN 'conductor' ELSE 'agent-' || ((n + k) %% {AGENTS}) END,
               'a subtask', '[]', false,
               CASE WHEN j.status = 'running' THEN (CASE WHEN k = 0 THEN 'running' ELSE 'pending' END)
                    WHEN j.status = 'failed' AND k = %(last)s THEN 'failed'
                    WHEN j.status = 'cancelled' AND k > 0 THEN 'cancelled' ELSE 'succeeded' END,
               200 + (n * 7 + k) %% 300, 50 + (n + k) %% 150, 0.0001 * ((n + k) %% 7),
               CASE WHEN j.status = 'running' THEN NULL ELSE (n::bigint * 7919 + k * 104729) %% 400000 END,
               CASE WHEN (n + k) %% 8 = 0 THEN 2 ELSE 1 END, CASE WHEN (n + k) %% 300 = 0 THEN 1 ELSE 0 END,
               j.started_at, j.started_at, j.finished_at
        FROM (SELECT id, status, started_at, finished_at, substr(id, 6)::int AS n FROM job
              WHERE id LIKE 'fill-%%' AND substr(id, 6)::int > %(base)s) AS j,
             generate_series(0, %(last)s) AS k
    """, {**params, "last": steps - 1})
    run("""
        INSERT INTO step_attempt (step_id, n, worker, started_at, finished_at, latency_ms, error_type)
        SELECT s.id, a, 'w1', s.started_at, CASE WHEN s.status = 'running' THEN NULL ELSE s.finished_at END,
               s.latency_ms, CASE WHEN a < s.attempts THEN 'rate_limited'
                                  WHEN s.status = 'failed' THEN 'server_error' END
        FROM step s JOIN job j ON j.id = s.job_id, generate_series(1, s.attempts) AS a
        WHERE j.id LIKE 'fill-%%' AND substr(j.id, 6)::int > %(base)s AND s.status NOT IN ('pending', 'cancelled')
    """, params)
    run("""
        INSERT INTO webhook_delivery (id, job_id, tenant, url, event_type, status, attempts, next_attempt_at,
                                      resends, created_at, finished_at, metrics_rolled_up_at)
        SELECT 'msg_' || j.id, j.id, j.tenant, 'https://hooks.example/x', 'job.' || j.status,
               CASE WHEN substr(j.id, 6)::int %% 40 = 0 THEN 'failed' ELSE 'delivered' END, 2, j.finished_at, 0,
               j.finished_at, j.finished_at + interval '5 seconds', j.metrics_rolled_up_at
        FROM job j
        WHERE j.id LIKE 'fill-%%' AND substr(j.id, 6)::int > %(base)s AND j.finished_at IS NOT NULL
          AND substr(j.id, 6)::int %% %(every)s = 0
    """, {**params, "every": delivery_every})
    run("""
        INSERT INTO webhook_attempt (delivery_id, n, started_at, finished_at, status_code, latency_ms)
        SELECT d.id, a, d.created_at, d.created_at, CASE WHEN a = 1 THEN 503 WHEN d.status = 'failed' THEN NULL
                                                        ELSE 200 END, 40
        FROM webhook_delivery d, generate_series(1, 2) AS a
        WHERE d.id LIKE 'msg_fill-%%' AND substr(d.id, 10)::int > %(base)s
    """, params)


def _time(label: str, body: Any, repeat: int) -> None:
    times = []
    for _ in range(repeat):
        started = time.perf_counter()
        body()
        times.append(time.perf_counter() - started)
    print(f"{label}: median {statistics.median(times):.3f} s, min {min(times):.3f}, max {max(times):.3f} "
          f"({repeat} runs)", flush=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.metrics_scale", description=__doc__.splitlines()[0])
    p.add_argument("command", choices=["fill", "scrape", "rollup"])
    p.add_argument("--url", required=True, help="a migrated database of its own")
    p.add_argument("--jobs", type=int, default=1_000_000)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--tenants", type=int, default=20)
    p.add_argument("--in-flight", type=int, default=200)
    p.add_argument("--recent", type=int, default=200, help="jobs that ended just now (not settled)")
    p.add_argument("--delivery-every", type=int, default=2)
    p.add_argument("--tenant", help="scrape: only this tenant's series (as its API key sees them)")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--code", help="import conductor from this checkout instead (the before of a comparison)")
    args = p.parse_args(argv)
    if args.code:
        sys.path.insert(0, args.code)
    os.environ["CONDUCTOR_DATABASE_URL"] = args.url
    from conductor.settings import get_settings

    get_settings.cache_clear()
    engine = sa.create_engine(args.url)
    if args.command == "fill":
        started = time.perf_counter()
        with engine.begin() as conn:
            fill(conn, jobs=args.jobs, steps=args.steps, tenants=args.tenants, in_flight=args.in_flight,
                 recent=args.recent, delivery_every=args.delivery_every)
        with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
            conn.exec_driver_sql("VACUUM ANALYZE")
        print(f"filled in {time.perf_counter() - started:.1f} s")
    elif args.command == "scrape":
        from sqlmodel import Session

        from conductor.store.metrics import read_aggregates

        def scrape() -> None:
            with Session(engine) as s:
                read_aggregates(s, tenant=args.tenant)

        _time(f"read_aggregates(tenant={args.tenant!r})", scrape, args.repeat)
    else:
        from conductor.reconcile import roll_up_metrics
        from conductor.store.models import utcnow

        started, folded = time.perf_counter(), {"metrics_rolled_up_jobs": 1}
        totals = {"metrics_rolled_up_jobs": 0, "metrics_rolled_up_deliveries": 0}
        while any(folded.values()):
            pass_started = time.perf_counter()
            folded = roll_up_metrics(get_settings(), now=utcnow())  # one pass's budget
            for k, v in folded.items():
                totals[k] += v
            print(f"pass: {folded} in {time.perf_counter() - pass_started:.2f} s", flush=True)
        print(f"rolled up {totals} in {time.perf_counter() - started:.1f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
