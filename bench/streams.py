"""``python -m bench.streams``: what open job event streams cost the API and the database.

    python -m bench.streams --url http://127.0.0.1:8000 --key cq_... --job JOB_ID --streams 300 \
        --database-url postgresql://postgres@127.0.0.1:5432/DB

Against a running API (``conductor serve``, with ``CONDUCTOR_TENANT_MAX_STREAMS`` at least ``--streams``)
and a job that stays queued (no worker; a long task makes a whole-row read show): it times 20
``GET /v1/jobs/{id}`` with no stream open, opens ``--streams`` ``GET /v1/jobs/{id}/events`` streams, reads
the database's transactions and tuples fetched per second over 5 s (``pg_stat_database``), and times the
same 20 GETs again. Timings are printed, never asserted.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from typing import Any

import httpx
import psycopg


def _database_stats(url: str) -> tuple[int, int]:
    with psycopg.connect(url) as conn:
        row = conn.execute("SELECT xact_commit + xact_rollback, tup_fetched FROM pg_stat_database "
                           "WHERE datname = current_database()").fetchone()
    assert row is not None
    return int(row[0]), int(row[1])


async def _hold(client: httpx.AsyncClient, path: str, headers: dict[str, str], ready: list[int]) -> None:
    async with client.stream("GET", path, headers=headers) as response:
        response.raise_for_status()
        ready.append(1)
        async for _ in response.aiter_raw():
            pass


async def _latency_ms(client: httpx.AsyncClient, path: str, headers: dict[str, str],
                      n: int = 20) -> tuple[float, float]:
    times = []
    for _ in range(n):
        started = time.perf_counter()
        (await client.get(path, headers=headers)).raise_for_status()
        times.append((time.perf_counter() - started) * 1000)
    return statistics.median(times), max(times)


async def run(args: Any) -> None:
    headers = {"Authorization": f"Bearer {args.key}"}
    job = f"/v1/jobs/{args.job}"
    limits = httpx.Limits(max_connections=args.streams + 10)
    async with (httpx.AsyncClient(base_url=args.url, timeout=120, limits=limits) as streams,
                httpx.AsyncClient(base_url=args.url, timeout=120) as probe):
        p50, worst = await _latency_ms(probe, job, headers)
        print(f"no stream open: GET {job} p50 {p50:.1f} ms, max {worst:.1f} ms", flush=True)
        ready: list[int] = []
        tasks = [asyncio.create_task(_hold(streams, f"{job}/events", headers, ready)) for _ in range(args.streams)]
        while len(ready) < args.streams:
            await asyncio.sleep(0.2)
            failed = [t for t in tasks if t.done() and t.exception() is not None]
            if failed:
                raise SystemExit(f"a stream could not be opened: {failed[0].exception()!r}")
        print(f"{args.streams} streams open", flush=True)
        await asyncio.sleep(2)
        before, started = _database_stats(args.database_url), time.monotonic()
        await asyncio.sleep(5)
        after, seconds = _database_stats(args.database_url), time.monotonic() - started
        print(f"database: {(after[0] - before[0]) / seconds:.0f} transactions/s, "
              f"{(after[1] - before[1]) / seconds:.0f} tuples fetched/s")
        p50, worst = await _latency_ms(probe, job, headers)
        print(f"{args.streams} streams open: GET {job} p50 {p50:.1f} ms, max {worst:.1f} ms")
        for task in tasks:
            task.cancel()


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m bench.streams", description=__doc__.splitlines()[0])
    p.add_argument("--url", required=True)
    p.add_argument("--key", required=True)
    p.add_argument("--job", required=True, help="a job that stays queued while measured")
    p.add_argument("--streams", type=int, default=300)
    p.add_argument("--database-url", required=True, help="the API's database, as a libpq URL")
    asyncio.run(run(p.parse_args()))


if __name__ == "__main__":
    main()
