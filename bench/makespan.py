"""Makespan vs critical path, and the per-hop overhead of the dispatch path, on real processes.

Starts one API and one Celery worker (threads pool) against the local Postgres and Redis (the test
database and Redis db 5 by default), submits workflows of sim steps with known latencies, and reports
for each shape: wall time from submit to succeeded, the critical path of step latencies, and the
overhead (wall - critical path) per hop on the critical path. Timings are printed, never asserted.

    .venv/bin/python -m bench.makespan [--repeat 5] [--latency-ms 200]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import httpx
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

os.environ.setdefault("CONDUCTOR_DATABASE_URL", os.environ.get(
    "CONDUCTOR_TEST_DATABASE_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/conductor_test"))
os.environ.setdefault("CONDUCTOR_BROKER_URL", "redis://127.0.0.1:6379/5")
os.environ.setdefault("CONDUCTOR_RESULT_BACKEND", "redis://127.0.0.1:6379/6")

from conductor.store.db import session_scope  # noqa: E402
from conductor.store.keys import create_key  # noqa: E402
from conductor.workflow import critical_path  # noqa: E402
from tests.integration.harness import start_api, start_worker, wait_terminal  # noqa: E402

SHAPES = {
    "single": [[]],
    "chain3": [[], [0], [1]],
    "fanout3+1": [[], [], [], [0, 1, 2]],
    "diamond": [[], [0], [0], [1, 2]],
    "n-graph": [[], [], [0], [0, 1]],
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--latency-ms", type=int, default=200)
    parser.add_argument("--concurrency", type=int, default=16)
    args = parser.parse_args()

    pools = Path(os.environ.get("TMPDIR", "/tmp")) / "conductor-bench-pools"
    pools.mkdir(exist_ok=True)
    agents = {f"s{i}": {"provider": "sim", "options": {"latency_ms": args.latency_ms}} for i in range(4)}
    (pools / "bench.yaml").write_text(yaml.safe_dump({"planner": "template:single", "agents": agents}))
    env = {**os.environ, "CONDUCTOR_POOLS_DIR": str(pools), "CONDUCTOR_AUTH_REQUIRED": "true"}
    with session_scope() as s:
        _, key = create_key(s, tenant="bench")

    print(f"starting API and a worker (threads, concurrency {args.concurrency}) ...", flush=True)
    worker = start_worker(env, "bench", concurrency=args.concurrency)
    api, url = start_api(env)
    try:
        with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {key}"}, timeout=30) as client:
            print(f"{'shape':<11} {'steps':>5} {'critical s':>10} {'wall s (median)':>16} {'overhead/hop ms':>16}")
            for name, deps in SHAPES.items():
                walls = []
                for _ in range(args.repeat):
                    wf = {"model_ids": [f"s{i % 4}" for i in range(len(deps))],
                          "subtasks": [f"step {i}" for i in range(len(deps))], "access_lists": deps}
                    started = time.perf_counter()
                    body = {"task": "bench", "pool": "bench", "workflow": wf}
                    job_id = client.post("/v1/jobs", json=body).json()["id"]
                    job = wait_terminal(client, job_id, timeout=120)
                    walls.append(time.perf_counter() - started)
                    assert job["status"] == "succeeded", job
                crit, path = critical_path(deps, [args.latency_ms / 1000] * len(deps))
                wall = statistics.median(walls)
                hops = len(path) + 2  # plan, each step on the critical path, finalize
                print(f"{name:<11} {len(deps):>5} {crit:>10.2f} {wall:>16.3f} {(wall - crit) / hops * 1000:>16.0f}",
                      flush=True)
    finally:
        api.stop()
        worker.stop()


if __name__ == "__main__":
    main()
