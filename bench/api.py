"""API load: ``POST /v1/jobs`` at a fixed open-loop rate (default 200 req/s for 60 s) against one API
process, from a raw-asyncio HTTP/1.1 client on loopback (``bench/loadgen.py``: its CPU per request is a
few percent of the API's, so the client is not what saturates). No worker runs: jobs are accepted (row
committed, plan message published) and left queued, so only the API path is measured.

Latency runs from each request's due time to its response (open loop, no coordinated omission). The API
process's CPU per accepted request comes from ``/proc``.
"""

from __future__ import annotations

import argparse
import asyncio
import uuid

from bench.env import Result, api_key, cpu_seconds, process_tree, services, summary, table, write_pool
from bench.loadgen import LoadResult, request_bytes, run_load

BODY = {"task": "api bench", "pool": "bench0",
        "workflow": {"model_ids": ["z"], "subtasks": ["s"], "access_lists": [[]]}}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--rate", type=float, nargs="+", default=[200.0],
                   help="requests per second; several rates run one after another on the same API process")
    p.add_argument("--seconds", type=float, default=60.0)
    p.add_argument("--api-workers", type=int, default=1, help="API processes (uvicorn --workers)")


def run(args: argparse.Namespace) -> Result:
    rates, seconds = ([20.0], 1.0) if args.quick else (list(args.rate), args.seconds)
    write_pool("bench0", {"z": 0})
    runs: list[tuple[float, LoadResult, float]] = []
    with services(api=True, api_workers=args.api_workers, workers=0, code=args.code) as svc:
        assert svc.api_url is not None
        url = svc.api_url

        def fresh_tenant() -> bytes:
            # No worker runs, so every accepted job stays in flight: each rate submits as a new tenant,
            # whose in-flight count (checked by every submit) starts at 0 and not at what earlier runs left.
            key = api_key(f"bench-api-{uuid.uuid4().hex[:12]}")
            return request_bytes(url, "/v1/jobs", BODY, {"Authorization": f"Bearer {key}"})

        api_pid = svc.procs[-1].popen.pid
        asyncio.run(run_load(url, fresh_tenant(), rate=min(rates[0], 20.0), seconds=0.5))  # warm up
        for rate in rates:
            request = fresh_tenant()
            api_pids = process_tree([api_pid])  # with --api-workers, uvicorn's supervisor and its workers
            before = cpu_seconds(api_pids)
            load = asyncio.run(run_load(svc.api_url, request, rate=rate, seconds=seconds))
            runs.append((rate, load, cpu_seconds(api_pids) - before))
    rows, data = [], []
    for rate, load, api_cpu in runs:
        s = summary(load.latencies)
        accepted = len(load.latencies)
        refused = sum(n for status, n in load.statuses.items() if not 200 <= status < 300)
        per_req = round(api_cpu / accepted * 1000, 2) if accepted else float("nan")
        rows.append([rate, seconds, round((accepted + refused + load.errors) / load.wall_s, 1), accepted,
                     refused + load.errors, s["p50_ms"], s["p99_ms"], per_req,
                     f"{100 * api_cpu / load.wall_s:.0f}%", f"{100 * load.client_cpu_s / load.wall_s:.0f}%"])
        data.append({"rate": rate, "seconds": seconds, "wall_s": load.wall_s, "accepted": accepted,
                     "refused": refused, "errors": load.errors, "statuses": load.statuses, "latency": s,
                     "api_cpu_ms_per_request": per_req, "client_cpu_s": load.client_cpu_s})
    md = table(["target req/s", "seconds", "achieved req/s", "accepted", "refused or failed", "p50 ms", "p99 ms",
                "API CPU ms/req", "API CPU", "client CPU"], rows)
    procs = "One API process" if args.api_workers == 1 else f"{args.api_workers} API processes"
    md += (f"\n\n{procs} (uvicorn) and an open-loop raw-asyncio client (`bench/loadgen.py`) on the "
           "same 2-core machine, loopback; an explicit 1-step workflow in each body; latency from each "
           "request's due time to its 202. CPU is the share of one core over the run's wall time. Each rate "
           "submits as a new tenant (no worker runs: its jobs stay in flight, and every submit counts them).")
    cmd = "python -m bench api --quick" if args.quick else \
        f"python -m bench api --rate {' '.join(f'{r:g}' for r in rates)} --seconds {seconds:g}" + (
            f" --api-workers {args.api_workers}" if args.api_workers != 1 else "")
    return Result("api", cmd, {"runs": data}, md)
