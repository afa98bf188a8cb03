"""Throughput: many jobs of 0 ms steps submitted at once; completed steps/s and jobs/s from the rows
(first job created to last job finished), with the CPU the worker and Postgres spent meanwhile, and
optionally a py-spy profile of the worker (``--profile``): what saturates.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from bench.env import (
    SHAPES,
    Result,
    cpu_seconds,
    job_times,
    postgres_pids,
    process_tree,
    profiled,
    services,
    submit_direct,
    table,
    wait_done,
    workflow,
    write_pool,
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--jobs", type=int, default=200)
    p.add_argument("--shape", default="fanout4+1", choices=sorted(SHAPES))
    p.add_argument("--profile", action="store_true", help="py-spy the worker while it runs")
    p.add_argument("--workers", type=int, default=1, help="worker processes (one per core uses every core)")


def run(args: argparse.Namespace) -> Result:
    jobs = 5 if args.quick else args.jobs
    deps = SHAPES[args.shape]
    write_pool("bench0", {"z": 0})
    with services(api=False, workers=args.workers, pool=args.pool, concurrency=args.concurrency,
                  code=args.code) as svc:
        wait_done(submit_direct([workflow([[]])], "bench0"))  # warm up
        pids = process_tree(svc.worker_pids)
        pg = postgres_pids()
        cpu0, pg0, t0 = cpu_seconds(pids), cpu_seconds(pg), time.monotonic()
        out = args.json_dir / "throughput-profile.txt" if args.profile and not args.quick else None
        with profiled(svc.worker_pids[0], 20, out) as profile:
            ids = submit_direct([workflow(deps)] * jobs, "bench0")
            wait_done(ids, timeout=900)
            wall_cpu = time.monotonic() - t0
        cpu1, pg1 = cpu_seconds(pids), cpu_seconds(pg)
    times = job_times(ids)
    failed = [j.id for j in times if j.status != "succeeded"]
    first = min(j.created for j in times)
    last = max(j.finished or 0.0 for j in times)
    window = last - first
    steps = sum(len(j.steps) for j in times)
    worker_cpu = (cpu1 - cpu0) / wall_cpu
    pg_cpu = (pg1 - pg0) / wall_cpu
    rows = [[args.shape, jobs, steps, round(window, 2), round(steps / window, 1), round(jobs / window, 1),
             f"{worker_cpu:.0%}", f"{pg_cpu:.0%}"]]
    md = table(["shape", "jobs", "steps", "window s", "steps/s", "jobs/s", "worker CPU", "Postgres CPU"], rows)
    procs = f"{args.workers} worker process{'es' if args.workers != 1 else ''}"
    md += (f"\n\n{procs}, each pool `{args.pool}` x{args.concurrency}; jobs submitted from the benchmark "
           f"process (no HTTP); window = first job created → last job finished. CPU is the share of one core "
           f"used while the jobs ran (of {_cores()} cores on the machine); Postgres CPU counts only the backends "
           f"alive at both ends of the window, an underestimate.")
    if failed:
        md += f"\n\n{len(failed)} jobs did not succeed."
    if profile:
        md += "\n\nWorker profile (py-spy, busy samples by library): " + ", ".join(
            f"{k} {v}%" for k, v in profile["by_library_pct"].items())
        md += "\n\nHottest functions: " + "; ".join(f"`{k}` {v}%" for k, v in profile["top_functions"][:5])
    data = {"shape": args.shape, "jobs": jobs, "steps": steps, "window_s": window, "steps_per_s": steps / window,
            "jobs_per_s": jobs / window, "worker_cpu_share": worker_cpu, "postgres_cpu_share": pg_cpu,
            "failed": len(failed), "profile": profile, "workers": args.workers, "pool": args.pool,
            "concurrency": args.concurrency}
    cmd = f"python -m bench throughput --jobs {args.jobs} --shape {args.shape} --workers {args.workers} " \
          f"--pool {args.pool} " \
          f"--concurrency {args.concurrency}" + (" --profile" if args.profile else "")
    return Result("throughput", cmd if not args.quick else "python -m bench throughput --quick", data, md)


def _cores() -> int:
    import os

    return os.cpu_count() or 1


__all__ = ["Path", "add_arguments", "run"]
