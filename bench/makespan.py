"""Makespan vs critical path: each shape with 1 s sim steps, one job at a time. Makespan is from the
plan (``job.planned_at``) to ``job.finished_at``; "e2e" from ``job.created_at`` (planning included).
The critical path is the longest chain of step latencies; the ratio is makespan / critical path.
"""

from __future__ import annotations

import argparse
import statistics

from bench.env import (
    SHAPES,
    Result,
    job_times,
    random_dags,
    services,
    submit_direct,
    table,
    wait_done,
    workflow,
    write_pool,
)
from conductor.workflow import critical_path


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--latency-ms", type=int, default=1000)


def run(args: argparse.Namespace) -> Result:
    repeat, latency = (1, 50) if args.quick else (args.repeat, args.latency_ms)
    write_pool("bench1s", {"w": latency})
    shapes = {name: [deps] * repeat for name, deps in SHAPES.items()}
    shapes["random≤5"] = random_dags(repeat * 3, seed=11)
    rows, data = [], {}
    with services(api=False, pool=args.pool, concurrency=args.concurrency, code=args.code):
        wait_done(submit_direct([workflow([[]], "w")], "bench1s"))
        for name, dags in shapes.items():
            ratios, spans, e2es, crits = [], [], [], []
            for deps in dags:
                ids = submit_direct([workflow(deps, "w")], "bench1s")
                wait_done(ids, timeout=300)
                (job,) = job_times(ids)
                assert job.status == "succeeded" and job.finished and job.planned, (name, job)
                crit, _ = critical_path(deps, [latency / 1000] * len(deps))
                span = job.finished - job.planned
                ratios.append(span / crit)
                spans.append(span)
                e2es.append(job.finished - job.created)
                crits.append(crit)
            worst = max(ratios)
            data[name] = {"critical_s": statistics.fmean(crits), "makespan_s": statistics.fmean(spans),
                          "e2e_s": statistics.fmean(e2es), "ratio_mean": statistics.fmean(ratios), "ratio_max": worst}
            rows.append([name, f"{statistics.fmean(crits):.2f}", f"{statistics.fmean(spans):.3f}",
                         f"{statistics.fmean(e2es):.3f}", f"{statistics.fmean(ratios):.3f}", f"{worst:.3f}"])
    md = table(["shape", "critical path s", "makespan s (mean)", "e2e s (mean)", "ratio mean", "ratio max"], rows)
    md += (f"\n\n{latency} ms steps, {repeat} runs per shape ({repeat * 3} random DAGs); "
           f"pool `{args.pool}` x{args.concurrency}.")
    cmd = "python -m bench makespan --quick" if args.quick else \
        f"python -m bench makespan --repeat {args.repeat} --latency-ms {args.latency_ms}"
    return Result("makespan", cmd, {"latency_ms": latency, "repeat": repeat, "shapes": data}, md)
