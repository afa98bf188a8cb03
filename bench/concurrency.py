"""Concurrency: 1,000 jobs of one 5 s sim call, all submitted at once to one worker process; how many
calls were in flight at once (from the attempts' start and finish times), the wall time from the first
call starting to the last finishing, and the peak RSS of the worker's process tree (sampled every
100 ms). With every call in flight together the wall is one call plus the time to start them all.
"""

from __future__ import annotations

import argparse
import threading
import time

import sqlalchemy as sa

from bench.env import (
    Result,
    process_tree,
    profiled,
    rss_bytes,
    services,
    submit_direct,
    table,
    wait_done,
    workflow,
    write_pool,
)
from conductor.store.db import get_engine


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--calls", type=int, default=1000)
    p.add_argument("--latency-ms", type=int, default=5000)
    p.add_argument("--workers", type=int, default=1,
                   help="worker processes, each with a pool of --calls slots (one per core takes the jobs faster)")
    p.add_argument("--profile", action="store_true",
                   help="py-spy the (first) worker for 10 s from the submit: what the intake spends its CPU on")


def run(args: argparse.Namespace) -> Result:
    calls, latency = (20, 500) if args.quick else (args.calls, args.latency_ms)
    pool = args.pool if args.pool != "threads" or args.concurrency >= calls else "gevent"
    concurrency = max(args.concurrency, calls)
    write_pool("benchslow", {"s": latency})
    peak = [0]
    with services(api=False, workers=args.workers, pool=pool, concurrency=concurrency, code=args.code) as svc:
        stop = threading.Event()

        def sample() -> None:
            while not stop.wait(0.1):
                peak[0] = max(peak[0], rss_bytes(process_tree(svc.worker_pids)))

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        idle_rss = rss_bytes(process_tree(svc.worker_pids))
        out = args.json_dir / "concurrency-profile.txt" if args.profile and not args.quick else None
        with profiled(svc.worker_pids[0], 10, out) as profile:
            t0 = time.monotonic()
            ids = submit_direct([workflow([[]], "s")] * calls, "benchslow")
            submitted = time.monotonic() - t0
            wait_done(ids, timeout=900)
        stop.set()
        sampler.join()
    with get_engine().connect() as conn:
        rows = list(conn.execute(sa.text(
            "SELECT j.status, a.started_at, a.finished_at FROM job j JOIN step s ON s.job_id = j.id "
            "JOIN step_attempt a ON a.step_id = s.id WHERE j.id = ANY(:ids)"), {"ids": ids}))
    ok = sum(1 for r in rows if r.status == "succeeded")
    events = sorted([(r.started_at.timestamp(), 1) for r in rows] + [(r.finished_at.timestamp(), -1) for r in rows])
    level = in_flight = 0
    for _, delta in events:
        level += delta
        in_flight = max(in_flight, level)
    first = min(r.started_at.timestamp() for r in rows)
    last = max(r.finished_at.timestamp() for r in rows)
    starts = sorted(r.started_at.timestamp() for r in rows)
    spread = starts[-1] - starts[0]
    md = table(["calls", "call s", "pool", "peak in flight", "succeeded", "wall s (first start → last finish)",
                "start spread s", "peak RSS MB", "idle RSS MB", "submit s"],
               [[calls, latency / 1000, f"{pool} x{concurrency}", in_flight, ok, round(last - first, 2),
                 round(spread, 2), round(peak[0] / 2**20), round(idle_rss / 2**20), round(submitted, 2)]])
    procs = "One worker process" if args.workers == 1 else f"{args.workers} worker processes"
    md += (f"\n\n{procs} (the planner and steps queues), jobs created in one transaction and published "
           "from the benchmark process. \"start spread\" is first call start → last call start: the time "
           "the workers needed to take every message, plan every job and claim every step. RSS: the workers' "
           "process trees together.")
    if profile:
        md += "\n\nWorker profile during the intake (py-spy, busy samples by library): " + ", ".join(
            f"{k} {v}%" for k, v in profile["by_library_pct"].items())
        md += "\n\nHottest functions: " + "; ".join(f"`{k}` {v}%" for k, v in profile["top_functions"][:5])
    data = {"calls": calls, "latency_ms": latency, "pool": pool, "concurrency": concurrency, "workers": args.workers,
            "peak_in_flight": in_flight,
            "succeeded": ok, "wall_s": last - first, "start_spread_s": spread, "peak_rss_bytes": peak[0],
            "idle_rss_bytes": idle_rss, "submit_s": submitted, "profile": profile}
    cmd = "python -m bench concurrency --quick" if args.quick else \
        f"python -m bench concurrency --calls {args.calls} --latency-ms {args.latency_ms} --pool {pool}" + (
            f" --workers {args.workers}" if args.workers != 1 else "") + (" --profile" if args.profile else "")
    return Result("concurrency", cmd, data, md)
