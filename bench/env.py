"""What every benchmark shares: where the services are, real API and worker processes, submitting
jobs, the server-side timestamps of finished jobs, percentiles, and writing results (JSON, and a
table in docs/benchmarks.md between ``<!-- bench:NAME -->`` markers).

The database and broker are the test ones (``CONDUCTOR_TEST_DATABASE_URL``) and a Redis db of the
benchmarks' own (``CONDUCTOR_BENCH_BROKER_URL``, default db 3), so a benchmark never shares a queue
with a test's workers.
"""

from __future__ import annotations

import json
import os
import platform
import random
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

BROKER = os.environ.get("CONDUCTOR_BENCH_BROKER_URL", "redis://127.0.0.1:6379/3")
os.environ.setdefault("CONDUCTOR_DATABASE_URL", os.environ.get(
    "CONDUCTOR_TEST_DATABASE_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/conductor_test"))
os.environ["CONDUCTOR_BROKER_URL"] = BROKER
os.environ["CONDUCTOR_RESULT_BACKEND"] = BROKER
POOLS = Path(os.environ.get("TMPDIR", "/tmp")) / f"conductor-bench-pools-{os.getpid()}"
os.environ["CONDUCTOR_POOLS_DIR"] = str(POOLS)
os.environ.setdefault("CONDUCTOR_AUTH_REQUIRED", "true")
os.environ["CONDUCTOR_MAX_STEPS"] = "20"  # the 20-step chain
# The benchmarks submit as one tenant, far past the per-tenant quotas a real deployment keeps.
os.environ.setdefault("CONDUCTOR_TENANT_SUBMITS_PER_MINUTE", "1000000")
os.environ.setdefault("CONDUCTOR_TENANT_MAX_JOBS_IN_FLIGHT", "1000000")

import redis  # noqa: E402
import sqlalchemy as sa  # noqa: E402

from conductor.settings import get_settings  # noqa: E402
from conductor.store.db import get_engine  # noqa: E402

get_settings.cache_clear()

# Workflow shapes: each step's access list (its dependencies).
SHAPES: dict[str, list[list[int]]] = {
    "1-step": [[]],
    "fanout4+1": [[], [], [], [], [0, 1, 2, 3]],
    "pev": [[], [0], [0, 1]],
    "diamond": [[], [0], [0], [1, 2]],
    "chain20": [[]] + [[i] for i in range(19)],
}


def random_dags(count: int, seed: int = 7, max_steps: int = 5) -> list[list[list[int]]]:
    """Random DAGs of 1..max_steps steps; the last step depends on every sink so it is the answer."""
    rng = random.Random(seed)
    dags = []
    for _ in range(count):
        n = rng.randint(1, max_steps)
        deps = [sorted(rng.sample(range(i), rng.randint(0, min(i, 2)))) if i else [] for i in range(n)]
        used = {d for ds in deps for d in ds}
        sinks = [i for i in range(n - 1) if i not in used]
        deps[-1] = sorted(set(deps[-1]) | set(sinks))
        dags.append(deps)
    return dags


def workflow(deps: Sequence[Sequence[int]], agent: str = "z") -> dict[str, Any]:
    return {"model_ids": [agent] * len(deps), "subtasks": [f"step {i}" for i in range(len(deps))],
            "access_lists": [list(d) for d in deps]}


def write_pool(name: str, agents: dict[str, int]) -> None:
    """A pool of sim agents, each with a fixed latency in ms."""
    POOLS.mkdir(parents=True, exist_ok=True)
    pool = {"planner": "template:single",
            "agents": {a: {"provider": "sim", "options": {"latency_ms": ms}} for a, ms in agents.items()}}
    (POOLS / f"{name}.yaml").write_text(yaml.safe_dump(pool))


def flush_broker() -> None:
    redis.Redis.from_url(BROKER).flushdb()


# --- processes ------------------------------------------------------------------------------------


@dataclass
class Services:
    api_url: str | None
    procs: list[Any] = field(default_factory=list)
    worker_pids: list[int] = field(default_factory=list)


def child_env(code: str | None = None) -> dict[str, str]:
    """The environment of the API and worker processes; ``code`` runs them on another checkout."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    path = [p for p in (code, str(ROOT)) if p]
    env["PYTHONPATH"] = os.pathsep.join(path + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    return env


@contextmanager
def services(*, api: bool = True, api_workers: int = 1, workers: int = 1, pool: str = "threads", concurrency: int = 16,
             code: str | None = None, extra_env: dict[str, str] | None = None) -> Iterator[Services]:
    from tests.integration.harness import Proc, start_api

    env = {**child_env(code), **(extra_env or {})}
    cwd = Path(code).resolve() if code else ROOT  # `python -m` imports from its working directory first
    flush_broker()
    out = Services(api_url=None)
    try:
        for i in range(workers):
            argv = [sys.executable, "-m", "conductor.cli", "worker", "--no-supervise", "--pool", pool,
                    "--concurrency", str(concurrency), "--hostname", f"bench{i}@%h", "--loglevel", "warning"]
            proc = Proc(f"bench-worker{i}", argv, env, cwd)
            _wait_ready(proc)
            out.procs.append(proc)
            out.worker_pids.append(proc.popen.pid)
        if api:
            proc, url = start_api(env, workers=api_workers, cwd=cwd)
            out.procs.append(proc)
            out.api_url = url
        yield out
    finally:
        for proc in out.procs:
            proc.stop()


def _wait_ready(proc: Any, timeout: float = 60) -> None:
    """A worker at loglevel warning prints nothing when ready: ask it over the broker instead."""
    from conductor.tasks.app import app

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.popen.poll() is not None:
            raise RuntimeError(f"worker exited early:\n{proc.tail()}")
        if app.control.ping(timeout=0.5):
            return
    raise RuntimeError(f"worker not ready:\n{proc.tail()}")


def api_key(tenant: str = "bench") -> str:
    from conductor.store.db import session_scope
    from conductor.store.keys import create_key

    with session_scope() as s:
        _, key = create_key(s, tenant=tenant, pepper=get_settings().api_key_pepper)
    return key


def submit_direct(workflows: Sequence[dict[str, Any]], pool: str, tenant: str = "bench") -> list[str]:
    """Creates the jobs (in one transaction) and publishes their plan messages from this process: what
    the API does, without HTTP, for runs where the API is not what is measured."""
    from conductor.store.db import session_scope
    from conductor.submission import JobCreate, create_job
    from conductor.tasks.send import enqueue_plan

    settings = get_settings()
    ids = []
    with session_scope() as s:
        for wf in workflows:
            job, _ = create_job(s, JobCreate.model_validate({"task": "bench", "pool": pool, "workflow": wf}),
                                tenant=tenant, settings=settings, publishing=True)
            ids.append(job.id)
    for job_id in ids:
        enqueue_plan(job_id, recorded=True)
    return ids


def wait_done(ids: Sequence[str], timeout: float = 600) -> None:
    """Polls the store until every job ended. Timings come from the rows, so the poll only has to stay
    cheap: it looks the jobs up by primary key (a status condition in SQL had Postgres scan the status
    index, every finished job's entries, ≈6 ms per poll beside a throughput run on the same 2 cores), and
    a large batch is polled every 0.25 s."""
    deadline = time.monotonic() + timeout
    pending = list(ids)
    ended = {"succeeded", "failed", "cancelled"}
    while pending:
        if time.monotonic() > deadline:
            raise RuntimeError(f"{len(pending)} jobs did not finish within {timeout}s")
        with get_engine().connect() as conn:
            done = {r[0] for r in conn.execute(sa.text("SELECT id, status FROM job WHERE id = ANY(:ids)"),
                                               {"ids": pending}) if r[1] in ended}
        pending = [i for i in pending if i not in done]
        if pending:
            time.sleep(0.05 if len(pending) <= 20 else 0.25)


# --- server-side timestamps -----------------------------------------------------------------------


@dataclass
class JobTimes:
    id: str
    status: str
    created: float
    planned: float | None
    finished: float | None
    steps: list[dict[str, Any]]


def job_times(ids: Sequence[str]) -> list[JobTimes]:
    def ts(v: datetime | None) -> float | None:
        return v.timestamp() if v is not None else None

    with get_engine().connect() as conn:
        jobs = {r.id: r for r in conn.execute(sa.text(
            "SELECT id, status, created_at, planned_at, finished_at FROM job WHERE id = ANY(:ids)"),
            {"ids": list(ids)})}
        steps: dict[str, list[dict[str, Any]]] = {}
        for r in conn.execute(sa.text(
                "SELECT job_id, index, access_list, queued_at, started_at, finished_at FROM step "
                "WHERE job_id = ANY(:ids) ORDER BY job_id, index"), {"ids": list(ids)}):
            steps.setdefault(r.job_id, []).append({"index": r.index, "deps": list(r.access_list),
                                                   "queued": ts(r.queued_at), "started": ts(r.started_at),
                                                   "finished": ts(r.finished_at)})
    return [JobTimes(j.id, j.status, j.created_at.timestamp(), ts(j.planned_at), ts(j.finished_at),
                     steps.get(j.id, [])) for j in (jobs[i] for i in ids)]


def step_hops(job: JobTimes, latency_s: float = 0.0) -> list[float]:
    """Per step: from the moment it could run (its last dependency finished; the plan for a root) to
    its own finish, less its simulated call: the orchestration cost of one hop, in seconds."""
    done = {s["index"]: s["finished"] for s in job.steps}
    hops = []
    for s in job.steps:
        ready = max((done[d] for d in s["deps"]), default=job.planned)
        if ready is not None and s["finished"] is not None:
            hops.append(s["finished"] - ready - latency_s)
    return hops


def pct(values: Sequence[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    k = (len(ordered) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


def ms(v: float) -> float:
    return round(v * 1000, 2)


def summary(values: Sequence[float]) -> dict[str, float]:
    return {"n": len(values), "p50_ms": ms(pct(values, 0.5)), "p99_ms": ms(pct(values, 0.99)),
            "mean_ms": ms(statistics.fmean(values)) if values else float("nan")}


# --- the machine and the results ------------------------------------------------------------------


def machine() -> dict[str, Any]:
    cpu = "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        with get_engine().connect() as conn:
            pg = str(conn.execute(sa.text("SHOW server_version")).scalar())
    except Exception:
        pg = "unknown"
    try:
        rv = str(redis.Redis.from_url(BROKER).info("server").get("redis_version"))
    except Exception:
        rv = "unknown"
    import timeit

    calib = min(timeit.repeat("sum(d.values())", "d = {i: i for i in range(1000)}", number=2000, repeat=5)) / 2000
    return {"cpu": cpu, "cores": os.cpu_count(), "load_1m": round(os.getloadavg()[0], 2),
            "calibration_us": round(calib * 1e6, 1),
            "python": platform.python_version(), "postgres": pg, "redis": rv,
            "date": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
            "git": _git_rev()}


def _git_rev() -> str:
    try:
        return subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    def cell(v: Any) -> str:
        return f"{v:.2f}" if isinstance(v, float) else str(v)

    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


@dataclass
class Result:
    name: str
    command: str
    data: dict[str, Any]
    markdown: str


def publish(result: Result, *, json_dir: Path, docs: Path | None) -> Path:
    """Writes ``json_dir/NAME.json`` and, with ``docs``, replaces the benchmark's section there."""
    json_dir.mkdir(parents=True, exist_ok=True)
    path = json_dir / f"{result.name}.json"
    info = machine()
    payload = {"name": result.name, "command": result.command, "machine": info, **result.data}
    path.write_text(json.dumps(payload, indent=2, default=str))
    if docs is not None:
        section = (f"<!-- bench:{result.name} -->\n```sh\n{result.command}\n```\n"
                   f"Measured {info['date']} at {info['git']} on {info['cores']} x {info['cpu']} "
                   f"(load average {info['load_1m']} at the start; the machine is shared; calibration "
                   f"{info['calibration_us']} µs, see above), Python "
                   f"{info['python']}, Postgres {info['postgres']}, Redis {info['redis']}.\n\n"
                   f"{result.markdown}\n<!-- /bench:{result.name} -->")
        text = docs.read_text() if docs.exists() else "# Benchmarks\n"
        start, end = f"<!-- bench:{result.name} -->", f"<!-- /bench:{result.name} -->"
        if start in text and end in text:
            text = text[:text.index(start)] + section + text[text.index(end) + len(end):]
        else:
            text = text.rstrip("\n") + f"\n\n## {result.name}\n\n{section}\n"
        docs.write_text(text)
    return path


# --- what the processes spent -----------------------------------------------------------------------


def _children(pid: int) -> list[int]:
    out = []
    try:
        for task in Path(f"/proc/{pid}/task").iterdir():
            out += [int(c) for c in (task / "children").read_text().split()]
    except OSError:
        pass
    return out


def process_tree(pids: Sequence[int]) -> list[int]:
    seen: list[int] = []
    todo = list(pids)
    while todo:
        pid = todo.pop()
        if pid not in seen:
            seen.append(pid)
            todo += _children(pid)
    return seen


def cpu_seconds(pids: Sequence[int]) -> float:
    tick = os.sysconf("SC_CLK_TCK")
    total = 0.0
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / tick
        except (OSError, IndexError, ValueError):
            pass
    return total


def rss_bytes(pids: Sequence[int]) -> int:
    total = 0
    for pid in pids:
        try:
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1]) * 1024
        except OSError:
            pass
    return total


def postgres_pids() -> list[int]:
    pids = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                if (d / "comm").read_text().strip() in ("postgres", "postmaster"):
                    pids.append(int(d.name))
            except OSError:
                pass
    return pids


@contextmanager
def profiled(pid: int, seconds: float, out: Path | None) -> Iterator[dict[str, Any]]:
    """With ``out``, samples ``pid`` with py-spy for ``seconds`` and reports the hottest leaf functions
    (idle waits excluded) in the yielded dict after the block. Only the thread holding the GIL is
    sampled (``--gil``): with 16 threads mostly waiting on sockets, sampling every thread reported
    psycopg's socket wait as 40 % of the "busy" time."""
    report: dict[str, Any] = {}
    proc = None
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        spy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")  # the venv's, off PATH
        proc = subprocess.Popen([spy, "record", "--pid", str(pid), "--duration", str(int(seconds)),
                                 "--rate", "200", "--gil", "--format", "raw", "--output", str(out), "--nonblocking"],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        yield report
    finally:
        if proc is not None:
            try:
                proc.wait(timeout=seconds + 30)
            except subprocess.TimeoutExpired:
                proc.kill()
            if out is not None and out.exists():
                report.update(summarize_profile(out))


IDLE = ("wait (threading.py", "select (selectors.py", "_wait_for_tstate_lock", "sleep (", "poll (selectors.py",
        "recv_into (", "wait (gevent", "switch (gevent", "get (gevent", "_recv (", "acquire (", "run (gevent",
        "readinto (socket.py", "wait_", "_read_from_socket", "read_response (", "wait (psycopg/connection.py")
GROUPS = (("sqlalchemy", "SQLAlchemy"), ("psycopg", "psycopg"), ("kombu", "kombu/Redis"), ("redis", "kombu/Redis"),
          ("celery", "Celery"), ("billiard", "Celery"), ("pydantic", "pydantic"), ("sqlmodel", "SQLAlchemy"),
          ("json", "json"), ("conductor", "conductor"), ("logging", "logging"), ("uuid", "other"))


def summarize_profile(path: Path) -> dict[str, Any]:
    """py-spy raw (collapsed) stacks -> busy samples by library (the innermost frame's package), and
    the hottest innermost functions."""
    busy: dict[str, int] = {}
    leaves: dict[str, int] = {}
    total = 0
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not count.isdigit():
            continue
        n = int(count)
        frames = stack.split(";")
        leaf = frames[-1]
        if any(marker in leaf for marker in IDLE):
            continue
        total += n
        group = "other"
        for frame in reversed(frames):
            hit = next((g for key, g in GROUPS if f"/{key}/" in frame or f"({key}/" in frame
                        or f"/{key}." in frame or f"({key}." in frame), None)
            if hit:
                group = hit
                break
        busy[group] = busy.get(group, 0) + n
        leaves[leaf] = leaves.get(leaf, 0) + n
    top = sorted(leaves.items(), key=lambda kv: -kv[1])[:8]
    return {"busy_samples": total,
            "by_library_pct": {k: round(100 * v / total, 1) for k, v in sorted(busy.items(), key=lambda kv: -kv[1])}
            if total else {},
            "top_functions": [(k, round(100 * v / total, 1)) for k, v in top] if total else []}
