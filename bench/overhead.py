"""Overhead per hop: the same DAGs of 0 ms steps on Conductor Queue (real API-less submit, one worker,
Postgres, Redis), on asyncio in one process (the floor), on a bare Celery canvas (the substrate) and
on LangGraph with its Postgres checkpointer (a durable peer), side by side in one run.

A hop is from the moment a step could run (its last dependency finished; for a root, the plan) to
the step's finish, from server-side timestamps (``step.finished_at``, ``job.planned_at``); "e2e" is
``job.finished_at - job.created_at`` (planning included). Jobs run one at a time, so nothing queues.

"CPU/job" is what each orchestrator's own process spent per job of a shape (user + system, from
``/proc``): Conductor Queue's worker, the no-op Celery worker (its result backend's chord bookkeeping
included), and the benchmark's process for LangGraph, which runs in it. Postgres and Redis are not
counted for any of them.
"""

from __future__ import annotations

import argparse
import os
import time
from typing import Any

from bench import peers
from bench.env import (
    SHAPES,
    Result,
    cpu_seconds,
    job_times,
    ms,
    pct,
    process_tree,
    random_dags,
    services,
    step_hops,
    submit_direct,
    summary,
    table,
    wait_done,
    workflow,
    write_pool,
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--repeat", type=int, default=20, help="runs per shape (random: this many DAGs)")
    p.add_argument("--no-peers", dest="peers", action="store_false", help="Conductor Queue only")


def run(args: argparse.Namespace) -> Result:
    repeat = 3 if args.quick else args.repeat
    shapes: dict[str, list[list[list[int]]]] = {name: [deps] * repeat for name, deps in SHAPES.items()}
    shapes["random≤5"] = random_dags(repeat)
    write_pool("bench0", {"z": 0})
    conductor = _conductor(shapes, args, {})
    # The same DAGs with every ready step sent through the broker (no continuation in the worker's slot).
    brokered = _conductor(shapes, args, {"CONDUCTOR_WORKER_CONTINUE_STEPS": "false"})
    floor = {name: _peer(lambda deps: peers.asyncio_hops(deps), dags) for name, dags in shapes.items()}
    celery: dict[str, Any] = {}
    graph: dict[str, Any] = {}
    missing = peers.langgraph_available()
    if args.peers:
        with peers.celery_worker() as noop:
            for name, dags in shapes.items():
                celery[name] = _peer(lambda deps, name=name: peers.celery_hops(name, deps), dags,
                                     pids=process_tree([noop.pid]))
        if missing is None:
            with peers.langgraph_saver() as saver:
                runs = iter(range(10**9))
                for name, dags in shapes.items():
                    graph[name] = _peer(
                        lambda deps, name=name: peers.langgraph_hops(saver, deps, f"{name}-{next(runs)}-{time.time()}"),
                        dags, pids=[os.getpid()])
    rows = []
    for name in shapes:
        c = conductor[name]
        rows.append([name, len(shapes[name][0]) if name != "random≤5" else "1-5",
                     c["hop"]["p50_ms"], c["hop"]["p99_ms"], c["e2e"]["p50_ms"], c["e2e"]["p99_ms"],
                     brokered[name]["hop"]["p50_ms"], brokered[name]["e2e"]["p50_ms"],
                     c["cpu_ms_per_job"], brokered[name]["cpu_ms_per_job"],
                     *_cells(floor[name]), *_cells(celery.get(name), cpu=True), *_cells(graph.get(name), cpu=True)])
    headers = ["shape", "steps", "CQ hop p50 ms", "CQ hop p99 ms", "CQ e2e p50 ms", "CQ e2e p99 ms",
               "CQ brokered hop p50", "CQ brokered e2e p50", "CQ CPU/job ms", "CQ brokered CPU/job",
               "asyncio hop p50", "asyncio e2e p50", "Celery hop p50", "Celery e2e p50", "Celery CPU/job",
               "LangGraph hop p50", "LangGraph e2e p50", "LangGraph CPU/job"]
    notes = [f"{repeat} runs per shape; worker pool `{args.pool}` x{args.concurrency}; jobs run one at a time, "
             "after one warm-up job of each shape (not counted), on every orchestrator.",
             "CQ: a worker runs the steps its step made ready itself, one in the same task and parallel ones beside it "
             "(the default); CQ brokered: every ready step "
             "goes through the broker (`CONDUCTOR_WORKER_CONTINUE_STEPS=false`).",
             "CPU/job: the orchestrator's own process per job (the worker; Celery's no-op worker; the benchmark's "
             "process for LangGraph), Postgres and Redis not counted."]
    if not args.peers:
        notes.append("Peers not run (`--no-peers`).")
    elif missing:
        notes.append(f"LangGraph: {missing}.")
    notes.append("Celery cannot express the random DAGs (or any non series-parallel graph) as one canvas: `—`.")
    markdown = table(headers, rows) + "\n\n" + "\n".join(notes)
    data = {"conductor": conductor, "conductor_brokered": brokered, "asyncio": floor, "celery": celery,
            "langgraph": graph or missing, "repeat": repeat, "pool": args.pool, "concurrency": args.concurrency}
    return Result("overhead", _command(args), data, markdown)


def _conductor(shapes: dict[str, list[list[list[int]]]], args: argparse.Namespace,
               env: dict[str, str]) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    with services(api=False, pool=args.pool, concurrency=args.concurrency, code=args.code, extra_env=env) as svc:
        for dags in shapes.values():  # warm the worker (imports, connections, each shape's statements)
            wait_done(submit_direct([workflow(dags[0])], "bench0"), timeout=120)
        pids = process_tree(svc.worker_pids)
        for name, dags in shapes.items():
            hops: list[float] = []
            e2e: list[float] = []
            cpu0 = cpu_seconds(pids)
            for deps in dags:
                ids = submit_direct([workflow(deps)], "bench0")
                wait_done(ids, timeout=120)
                (job,) = job_times(ids)
                assert job.status == "succeeded", (name, job)
                hops += step_hops(job)
                assert job.finished is not None
                e2e.append(job.finished - job.created)
            out[name] = {"hop": summary(hops), "e2e": summary(e2e), "cpu_ms_per_job": _per_job(cpu0, pids, dags)}
    return out


def _peer(fn: Any, dags: list[list[list[int]]], pids: list[int] | None = None) -> dict[str, Any] | None:
    hops: list[float] = []
    e2e: list[float] = []
    if fn(dags[0]) is None:  # a warm-up run, not counted (as for Conductor Queue): imports, connections
        return None
    cpu0 = cpu_seconds(pids or [])
    for deps in dags:
        out = fn(deps)
        if out is None:
            return None
        hops += out[0]
        e2e.append(out[1])
    result: dict[str, Any] = {"hop": summary(hops), "e2e": summary(e2e)}
    if pids:
        result["cpu_ms_per_job"] = _per_job(cpu0, pids, dags)
    return result


def _per_job(cpu0: float, pids: list[int], dags: list[list[list[int]]]) -> float:
    """CPU milliseconds per job since ``cpu0`` (``/proc`` counts in clock ticks, 10 ms: a mean over many jobs)."""
    return round((cpu_seconds(pids) - cpu0) * 1000 / max(len(dags), 1), 2)


def _cells(peer: dict[str, Any] | None, *, cpu: bool = False) -> list[Any]:
    if not peer:
        return ["—"] * (3 if cpu else 2)
    return [peer["hop"]["p50_ms"], peer["e2e"]["p50_ms"], *([peer.get("cpu_ms_per_job", "—")] if cpu else [])]


def _command(args: argparse.Namespace) -> str:
    return "python -m bench overhead" + (f" --repeat {args.repeat}" if not args.quick else " --quick") + (
        f" --pool {args.pool} --concurrency {args.concurrency}")


__all__ = ["add_arguments", "ms", "pct", "run"]
