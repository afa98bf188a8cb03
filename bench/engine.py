"""The engine's own cost per step, in one process (no broker, no worker): ``run_step`` over chains of
0 ms steps against the real Postgres, with wall time, CPU time and the SQL statements each step sends.

This is the floor under every other Conductor Queue figure: what a step costs before Celery and Redis
add their hop. Statements are counted with a SQLAlchemy ``before_cursor_execute`` listener (``BEGIN`` and
``COMMIT`` are not statements there; each transaction adds those two round trips).
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import sqlalchemy as sa

from bench.env import Result, table, workflow, write_pool


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--steps", type=int, default=20, help="steps per chain")
    p.add_argument("--runs", type=int, default=5, help="chains (after one warm-up chain)")


def run(args: argparse.Namespace) -> Result:
    from conductor.engine import plan_job, run_step
    from conductor.settings import get_settings
    from conductor.store.db import get_engine, session_scope
    from conductor.submission import JobCreate, create_job

    steps, runs = (5, 2) if args.quick else (args.steps, args.runs)
    write_pool("bench0", {"z": 0})
    get_settings.cache_clear()
    settings = get_settings()
    statements = 0

    def count(*_: Any) -> None:
        nonlocal statements
        statements += 1

    def chain() -> tuple[float, float, float]:
        nonlocal statements
        with session_scope() as s:
            job, _ = create_job(s, JobCreate.model_validate({"task": "bench", "pool": "bench0",
                                                             "workflow": workflow([[i - 1] if i else []
                                                                                   for i in range(steps)])}),
                                tenant="bench", settings=settings)
            job_id = job.id
        plan_job(job_id, settings=settings)
        statements = 0
        wall0, cpu0 = time.perf_counter(), time.process_time()
        for index in range(steps):
            run_step(job_id, index, worker="bench-engine", task_id=None, settings=settings)
        wall, cpu = time.perf_counter() - wall0, time.process_time() - cpu0
        return wall / steps * 1000, cpu / steps * 1000, statements / steps

    hot = get_engine()  # the engine `transaction` runs the hot path on
    sa.event.listen(hot, "before_cursor_execute", count)
    try:
        chain()  # warm-up: imports, connections, prebuilt statements
        measured = [chain() for _ in range(runs)]
    finally:
        sa.event.remove(hot, "before_cursor_execute", count)
    wall = [m[0] for m in measured]
    cpu = [m[1] for m in measured]
    per_step = measured[-1][2]
    rows = [[f"chain of {steps}", runs, round(statistics.median(wall), 2), round(min(wall), 2),
             round(statistics.median(cpu), 2), round(min(cpu), 2), round(per_step, 1)]]
    md = table(["workload", "chains", "wall ms/step (median)", "wall ms/step (best)", "CPU ms/step (median)",
                "CPU ms/step (best)", "SQL statements/step"], rows)
    md += ("\n\n`run_step` called in this process for each step of a chain in turn (0 ms sim agent, no broker); "
           "wall and CPU from `time.perf_counter` and `time.process_time`; two transactions per step, so add "
           "a `BEGIN` and a `COMMIT` round trip to each for the statements Postgres sees.")
    data = {"steps": steps, "runs": runs, "wall_ms_per_step": wall, "cpu_ms_per_step": cpu,
            "statements_per_step": per_step}
    cmd = "python -m bench engine --quick" if args.quick else f"python -m bench engine --steps {steps} --runs {runs}"
    return Result("engine", cmd, data, md)


__all__ = ["add_arguments", "run"]
