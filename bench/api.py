"""API load: ``POST /v1/jobs`` at a fixed open-loop rate (default 200 req/s for 60 s) from an async client
on loopback, against one API process; p50/p99 latency as the client saw it. No worker runs: jobs are
accepted (row committed, plan message published) and left queued, so only the API path is measured.
"""

from __future__ import annotations

import argparse
import asyncio
import time

import httpx

from bench.env import Result, api_key, services, summary, table, write_pool


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--rate", type=float, default=200.0)
    p.add_argument("--seconds", type=float, default=5.0)


async def _load(url: str, key: str, rate: float, seconds: float) -> tuple[list[float], int, float]:
    body = {"task": "api bench", "pool": "bench0",
            "workflow": {"model_ids": ["z"], "subtasks": ["s"], "access_lists": [[]]}}
    latencies: list[float] = []
    errors = 0
    limits = httpx.Limits(max_connections=512, max_keepalive_connections=512)
    async with httpx.AsyncClient(base_url=url, headers={"Authorization": f"Bearer {key}"}, timeout=30,
                                 limits=limits) as client:
        async def one() -> None:
            nonlocal errors
            t = time.perf_counter()
            try:
                r = await client.post("/v1/jobs", json=body)
                ok = r.status_code == 202
            except httpx.HTTPError:
                ok = False
            if ok:
                latencies.append(time.perf_counter() - t)
            else:
                errors += 1

        tasks = []
        start = time.perf_counter()
        n = int(rate * seconds)
        for i in range(n):
            delay = start + i / rate - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one()))
        await asyncio.gather(*tasks)
        return latencies, errors, time.perf_counter() - start


def run(args: argparse.Namespace) -> Result:
    rate, seconds = (20.0, 1.0) if args.quick else (args.rate, args.seconds)
    write_pool("bench0", {"z": 0})
    key = api_key()
    with services(api=True, workers=0, code=args.code) as svc:
        assert svc.api_url is not None
        asyncio.run(_load(svc.api_url, key, min(rate, 20.0), 0.5))  # warm up
        latencies, errors, wall = asyncio.run(_load(svc.api_url, key, rate, seconds))
    s = summary(latencies)
    achieved = (len(latencies) + errors) / wall
    md = table(["target req/s", "seconds", "achieved req/s", "accepted", "errors", "p50 ms", "p99 ms"],
               [[rate, seconds, round(achieved, 1), len(latencies), errors, s["p50_ms"], s["p99_ms"]]])
    md += ("\n\nOne API process (uvicorn, 1 worker), open-loop async client on the same machine (loopback), "
           "explicit 1-step workflow in each body; latency is the client's, request sent → 202 received.")
    cmd = "python -m bench api --quick" if args.quick else \
        f"python -m bench api --rate {args.rate} --seconds {args.seconds}"
    return Result("api", cmd, {"rate": rate, "seconds": seconds, "achieved_rate": achieved, "accepted": len(latencies),
                               "errors": errors, "latency": s}, md)
