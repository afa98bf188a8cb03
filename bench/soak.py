"""A chaos soak: real processes under a mixed load and injected faults, then invariants checked from the rows.

    python -m bench.soak --database-url postgresql+psycopg://postgres@127.0.0.1:5432/conductor_soak \\
        --broker-url redis://127.0.0.1:6379/14 --result-backend redis://127.0.0.1:6379/15 --minutes 12

It starts one API (``conductor serve``), three workers (threads x8, gevent x20, threads x4; every queue),
``conductor beat`` (the reconciler, every 2 s), a loopback OpenAI-compatible and Anthropic provider that
injects latency, 429s with Retry-After, 500/503/529s, hangs past the agent's timeout, truncated JSON,
dropped connections and answers cut at ``length``, and a webhook receiver that answers 500, 429 and too
late now and then. Three tenants submit, for ``--minutes``: jobs with request workflows (recursive steps,
budgets, webhooks and idempotency keys among them), planned jobs (a planner model on the fake provider,
templates), chat completions through the ``openai`` SDK (stream and not), batches (some cancelled), cancels,
replays, event streams and reads of the other tenants' jobs. Every 60-120 s one worker process is
SIGKILLed and started again. Then submitting stops, everything drains (bounded), and the checks run:

- every job ended; no step pending, queued or running on an ended job; a succeeded job's steps all succeeded;
- a job's usage is its planner's plus its steps' (a recursive step's being its child job's), its calls its
  planner's plus its steps' attempts; no step has two successful attempts, a run step that succeeded has
  exactly one, attempt numbers run 1..n, and no attempt of an ended job is left open;
- every ended top-level job with a webhook URL has a delivery, every delivery ended, its type is the job's,
  a delivered one reached the receiver, and every send of one delivery carried the same body;
- each batch ended, its request counts equal its lines' outcomes, and its files hold one line per request;
- ``/metrics`` (all tenants, and each tenant with its own key) equals the same aggregates from the rows,
  after the reconciler's rollup folded the ended jobs;
- another tenant's key reads none of a tenant's jobs, steps, deliveries, batches or files (404);
- chat answers and streams equal their jobs' answers and usage; an idempotent re-submit returns its job;
- no worker, API or beat log holds a traceback.

It TRUNCATES the database's tables and flushes both Redis dbs: give it a database and Redis dbs of its
own, never a shared one. Postgres and Redis themselves are never touched, unless ``--service-chaos``:
then the soak runs a Postgres cluster and a Redis server of its own (``bench/services.py``, on
``--pg-port`` and ``--redis-port``, in ``--workdir``) and restarts them under the load (Postgres fast or
immediate, Redis with its data or without, or both), and checks besides that the API answers 503 with a
problem body while Postgres is down, accepts submissions while Redis is down, recovers within a bound,
that the clients' retries of 503s succeed, and that no process exits unasked. Logs, the pool file and the
report (``report.json``, and the text printed at the end) go to ``--workdir``. Exits 1 when any check
failed. Not part of ``make test``; docs/benchmarks.md describes a run.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

TERMINAL = ("succeeded", "failed", "cancelled")
TENANTS = ("soak-a", "soak-b", "soak-c")
DEFAULT_HOOK_TENANT = "soak-c"
"""This tenant has a default webhook URL: all its top-level jobs are owed a delivery."""
STEP_AGENTS = ("oa-fast", "oa-flaky", "an-fast", "sim-a")
METRICS_TOKEN = "soak-metrics-token"
ANTHROPIC_KEY_ENV = "SOAK_ANTHROPIC_KEY"


# --- the fake providers (a process of their own: `python -m bench.soak provider`) ------------------------------

FAULTS: dict[str, list[tuple[int, str]]] = {
    # model -> (weight, outcome)
    "fast": [(80, "ok"), (5, "rate_limit"), (4, "server"), (2, "unavailable"), (2, "hang"), (2, "malformed"),
             (2, "drop"), (3, "length")],
    "flaky": [(55, "ok"), (12, "rate_limit"), (10, "server"), (4, "unavailable"), (6, "hang"), (5, "malformed"),
              (4, "drop"), (4, "length")],
    "planner": [(78, "ok"), (8, "garbage"), (6, "server"), (4, "rate_limit"), (2, "hang"), (2, "malformed")],
}
HANG_S = 5.0
"""Longer than every agent's ``timeout_s`` (3 s): the call times out."""


def provider_main(args: argparse.Namespace) -> int:
    """Serves the fake OpenAI and Anthropic APIs until SIGTERM; writes their base URLs to ``--ready``."""
    from tests.fakes.anthropic_server import FakeAnthropicServer
    from tests.fakes.http_base import Reply
    from tests.fakes.openai_server import FakeOpenAIServer

    rng = random.Random(args.seed)
    lock = threading.Lock()
    seen: Counter[str] = Counter()

    def pick(model: str) -> str:
        table = FAULTS.get(model, FAULTS["fast"])
        with lock:
            outcome = rng.choices([o for _, o in table], weights=[w for w, _ in table])[0]
            seen[f"{model}:{outcome}"] += 1
            return outcome

    def reply(body: Any, anthropic: bool) -> Reply:
        body = body if isinstance(body, dict) else {}
        model = str(body.get("model", "fast"))
        outcome = pick(model)
        delay = rng.uniform(0.02, 0.3) if model != "flaky" else rng.uniform(0.2, 2.5)
        if outcome == "rate_limit":
            return Reply(status=429, error="soak: rate limited", headers={"retry-after": str(rng.choice([1, 2]))})
        if outcome == "server":
            return Reply(status=500, error="soak: internal error", delay_s=delay)
        if outcome == "unavailable":
            return Reply(status=529 if anthropic else 503, error="soak: overloaded")
        if outcome == "hang":
            return Reply(delay_s=HANG_S)
        if outcome == "malformed":
            return Reply(body=b'{"id": "soak-truncated", "choices": [{"index": 0, "mess', delay_s=delay)
        if outcome == "drop":
            return Reply(drop=True, delay_s=delay)
        if model == "planner":
            text = _planner_text(body, rng) if outcome == "ok" else "I would rather not plan today."
            return Reply(text=text, delay_s=delay)
        text = f"[{model}] answer {rng.randrange(10**6)}: " + " ".join(["word"] * rng.randint(3, 40))
        limit = body.get("max_tokens") or body.get("max_completion_tokens")
        words = text.split()
        if isinstance(limit, int) and len(words) > limit:  # as a real model: cut at max_tokens ("words" here)
            text, outcome = " ".join(words[:limit]), "length"
        if outcome == "length":
            text = " ".join(text.split()[:3])
            return Reply(text=text, delay_s=delay, finish_reason="max_tokens" if anthropic else "length")
        return Reply(text=text, delay_s=delay)

    openai_srv = FakeOpenAIServer(lambda body: reply(body, anthropic=False)).start()
    anthropic_srv = FakeAnthropicServer(lambda body: reply(body, anthropic=True)).start()
    Path(args.ready).write_text(json.dumps({"openai": openai_srv.base_url, "anthropic": anthropic_srv.base_url}))
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    while not stop.wait(30):
        with lock:
            print("provider outcomes:", json.dumps(dict(sorted(seen.items()))), flush=True)
    with lock:
        print("provider outcomes (final):", json.dumps(dict(sorted(seen.items()))), flush=True)
    openai_srv.stop()
    anthropic_srv.stop()
    return 0


def _planner_text(body: dict[str, Any], rng: random.Random) -> str:
    """A workflow as the conductor model writes one: 1-4 steps over the step agents, now and then a
    recursive ``conductor`` step (the child job then plans with the same planner)."""
    n = rng.randint(1, 4)
    agents = [rng.choice(STEP_AGENTS) for _ in range(n)]
    if n > 1 and rng.random() < 0.15:
        agents[0] = "conductor"
    access = [sorted(rng.sample(range(i), rng.randint(0, min(i, 2)))) if i else [] for i in range(n)]
    return json.dumps({"model_ids": agents, "subtasks": [f"part {i} of the task" for i in range(n)],
                       "access_lists": access})


# --- the webhook receiver (in the soak process) ------------------------------------------------------------------


@dataclass
class Hooks:
    """What the receiver got: per webhook-id the distinct bodies, the answers it gave and the job ids."""

    bodies: dict[str, set[bytes]] = field(default_factory=lambda: defaultdict(set))
    answers: dict[str, list[int]] = field(default_factory=lambda: defaultdict(list))
    job_of: dict[str, str] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)


def serve_hooks(rng: random.Random) -> tuple[ThreadingHTTPServer, Hooks, str]:
    hooks = Hooks()

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers.get("content-length", 0)))
            hook_id = self.headers.get("webhook-id", "")
            roll = rng.random()
            status, headers = 200, {}
            if roll < 0.08:
                status = 500
            elif roll < 0.12:
                status, headers = 429, {"retry-after": "1"}
            elif roll < 0.15:
                time.sleep(4)  # past CONDUCTOR_WEBHOOK_TIMEOUT_S: the attempt times out and is retried
            with hooks.lock:
                hooks.bodies[hook_id].add(body)
                hooks.answers[hook_id].append(status)
                with contextlib.suppress(ValueError, KeyError, TypeError):
                    hooks.job_of[hook_id] = json.loads(body)["data"]["id"]
            with contextlib.suppress(OSError):
                self.send_response(status)
                for name, value in {**headers, "content-length": "0"}.items():
                    self.send_header(name, value)
                self.end_headers()

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True, name="hooks").start()
    return server, hooks, f"http://127.0.0.1:{server.server_address[1]}/hook"


# --- processes -------------------------------------------------------------------------------------------------


class Proc:
    """A child process in a session of its own (so a kill takes its children), its output in a log file."""

    def __init__(self, name: str, argv: list[str], env: dict[str, str], logs: Path):
        self.name, self.argv, self.env, self.logs = name, argv, env, logs
        self.incarnation = -1
        self.log_paths: list[Path] = []
        self.popen: subprocess.Popen[bytes] | None = None
        self.start()

    def start(self) -> None:
        self.incarnation += 1
        path = self.logs / f"{self.name}.{self.incarnation}.log"
        self.log_paths.append(path)
        argv = [a.replace("{n}", str(self.incarnation)) for a in self.argv]
        with path.open("wb") as log:
            self.popen = subprocess.Popen(argv, env=self.env, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                                          start_new_session=True)

    def wait_for_log(self, needle: str, timeout: float = 90) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if needle in self.log_paths[-1].read_text(errors="replace"):
                return
            assert self.popen is not None
            if self.popen.poll() is not None:
                raise RuntimeError(f"{self.name} exited early; see {self.log_paths[-1]}")
            time.sleep(0.2)
        raise RuntimeError(f"{self.name} did not log {needle!r} within {timeout}s; see {self.log_paths[-1]}")

    def kill(self) -> None:
        assert self.popen is not None
        if self.popen.poll() is None:
            os.killpg(self.popen.pid, signal.SIGKILL)
        self.popen.wait(timeout=30)

    def stop(self) -> None:
        if self.popen is None or self.popen.poll() is not None:
            return
        os.killpg(self.popen.pid, signal.SIGTERM)
        try:
            self.popen.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.kill()


WORKERS = (("w-threads8", "threads", 8), ("w-gevent20", "gevent", 20), ("w-threads4", "threads", 4))


def start_worker(name: str, pool: str, concurrency: int, env: dict[str, str], logs: Path,
                 supervise: bool = False) -> Proc:
    """``supervise``: as deployed, ``conductor worker`` restarts its Celery worker when it exits (it does when
    Redis goes away under an unacknowledged message); the plain soak runs Celery in the foreground."""
    argv = [sys.executable, "-m", "conductor.cli", "worker", *([] if supervise else ["--no-supervise"]),
            "--pool", pool, "--concurrency", str(concurrency), "--queues", "planner,steps,maintenance,webhooks",
            "--hostname", f"{name}-{{n}}@soak", "--loglevel", "info"]
    proc = Proc(name, argv, env, logs)
    proc.wait_for_log("ready.")
    return proc


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def soak_env(args: argparse.Namespace, workdir: Path) -> dict[str, str]:
    return {
        **os.environ,
        "PYTHONUNBUFFERED": "1",
        "CONDUCTOR_DATABASE_URL": args.database_url,
        "CONDUCTOR_BROKER_URL": args.broker_url,
        "CONDUCTOR_RESULT_BACKEND": args.result_backend,
        "CONDUCTOR_POOL_FILE": str(workdir / "pools" / "soak.yaml"),
        "CONDUCTOR_POOLS_DIR": str(workdir / "pools"),
        "CONDUCTOR_DATA_DIR": str(workdir / "data"),
        "CONDUCTOR_AUTH_REQUIRED": "true",
        "CONDUCTOR_METRICS_TOKEN": METRICS_TOKEN,
        ANTHROPIC_KEY_ENV: "soak-anthropic-key",
        # Recovery within the soak's patience: short leases, a pass every 2 s.
        "CONDUCTOR_STEP_LEASE_S": "6",
        "CONDUCTOR_PLANNING_STALE_S": "8",
        "CONDUCTOR_RECONCILE_INTERVAL_S": "2",
        "CONDUCTOR_RECONCILE_STALE_S": "5",
        "CONDUCTOR_RETRY_BACKOFF_BASE_S": "0.1",
        "CONDUCTOR_RETRY_BACKOFF_MAX_S": "1",
        "CONDUCTOR_RATE_LIMIT_WAIT_S": "2",
        "CONDUCTOR_PROVIDER_TIMEOUT_S": "3",
        "CONDUCTOR_CHAT_MAX_WAIT_S": "240",
        # Ended work folds into the rollup within the drain.
        "CONDUCTOR_METRICS_SETTLE_S": "5",
        "CONDUCTOR_METRICS_ABANDONED_S": "45",
        "CONDUCTOR_WEBHOOK_ALLOW_LOOPBACK": "true",
        "CONDUCTOR_WEBHOOK_BACKOFF_S": "[0.5, 1, 2, 4]",
        "CONDUCTOR_WEBHOOK_TIMEOUT_S": "3",
        "CONDUCTOR_TENANT_SUBMITS_PER_MINUTE": "100000",
        "CONDUCTOR_TENANT_MAX_JOBS_IN_FLIGHT": "150",
        "CONDUCTOR_TENANT_MAX_STREAMS": "30",
        # Postgres is shared: each process keeps few connections (a gevent worker's greenlets wait for one).
        "CONDUCTOR_DB_POOL_SIZE": "4",
        "CONDUCTOR_DB_MAX_OVERFLOW": "6",
        "CONDUCTOR_WORKER_LOCAL_SLOTS": "4",
    }


def write_pool(workdir: Path, urls: dict[str, str]) -> None:
    def openai_agent(model: str, price: tuple[float, float]) -> dict[str, Any]:
        return {"provider": "openai_compatible", "model": model, "base_url": urls["openai"], "timeout_s": 3,
                "price": {"input_per_mtok": price[0], "output_per_mtok": price[1]}, "structured_output": False}

    pool = {
        "planner": "template:pev",
        "fallback": "template:single",
        "agents": {
            "planner-oa": openai_agent("planner", (3.0, 6.0)),
            "oa-fast": openai_agent("fast", (1.0, 2.0)),
            "oa-flaky": openai_agent("flaky", (0.5, 1.5)),
            "an-fast": {"provider": "anthropic", "model": "fast", "base_url": urls["anthropic"], "timeout_s": 3,
                        "api_key_env": ANTHROPIC_KEY_ENV, "price": {"input_per_mtok": 2.0, "output_per_mtok": 4.0}},
            "sim-a": {"provider": "sim", "options": {"latency_ms": 150, "fail_with": ["rate_limit"],
                                                     "retry_after_s": 0.3}},
        },
    }
    import yaml

    (workdir / "pools").mkdir(parents=True, exist_ok=True)
    (workdir / "pools" / "soak.yaml").write_text(yaml.safe_dump(pool, sort_keys=False))


# --- the load --------------------------------------------------------------------------------------------------


@dataclass
class Ledger:
    """What the load did, for the checks: every job it created and what it expects of it."""

    jobs: dict[str, dict[str, Any]] = field(default_factory=dict)
    batches: dict[str, dict[str, Any]] = field(default_factory=dict)
    files: dict[str, str] = field(default_factory=dict)
    chats: list[dict[str, Any]] = field(default_factory=list)
    responses: list[dict[str, Any]] = field(default_factory=list)
    """Each Responses API call: its response (= job) id, what it was told, and what it continued."""
    violations: list[dict[str, Any]] = field(default_factory=list)
    actions: Counter[str] = field(default_factory=Counter)
    lock: threading.Lock = field(default_factory=threading.Lock)
    services_restart: bool = False
    """--service-chaos: an event stream may end with ``job_read_failed`` while Postgres is down."""

    def job(self, job_id: str, tenant: str, kind: str, **info: Any) -> None:
        with self.lock:
            self.jobs[job_id] = {"tenant": tenant, "kind": kind, **info}

    def count(self, action: str) -> None:
        with self.lock:
            self.actions[action] += 1

    def violation(self, check: str, **detail: Any) -> None:
        with self.lock:
            self.violations.append({"check": check, **detail})

    def mine(self, tenant: str, kinds: tuple[str, ...] = ()) -> list[tuple[str, dict[str, Any]]]:
        with self.lock:
            return [(i, j) for i, j in self.jobs.items() if j["tenant"] == tenant and (not kinds or j["kind"] in kinds)]


def random_workflow(rng: random.Random, *, recursive: bool) -> dict[str, Any]:
    n = rng.randint(1, 5)
    agents = [rng.choice(STEP_AGENTS) for _ in range(n)]
    if recursive and n > 1:
        agents[rng.randrange(n - 1)] = "conductor"
    access = [sorted(rng.sample(range(i), rng.randint(0, min(i, 2)))) if i else [] for i in range(n)]
    return {"model_ids": agents, "subtasks": [f"subtask {i}" for i in range(n)], "access_lists": access}


RETRY_503_FOR_S = 120.0
"""How long a client keeps retrying the service's 503s ("retry shortly"), Retry-After apart: past every
outage the service chaos makes (at most SERVICE_DOWN_S plus Postgres's recovery)."""


class RetryingClient:
    """An ``httpx.Client`` that does what the service asks of a client on a 503: waits Retry-After and sends
    again, for up to ``RETRY_503_FOR_S``. Each 503 must carry a problem body (RFC 9457) or, on the OpenAI
    routes, an OpenAI error body; one that does not is a violation. The answer after the retries is the
    caller's to judge (a 503 still is then an unexpected status)."""

    def __new__(cls, ledger: Ledger, **kwargs: Any) -> Any:
        import httpx

        class _Client(httpx.Client):
            def send(self, request: Any, **kw: Any) -> Any:
                give_up = time.monotonic() + RETRY_503_FOR_S
                while True:
                    response = super().send(request, **kw)
                    if response.status_code != 503:
                        return response
                    response.read()
                    ledger.count(f"503 {request.method} {_route(request.url.path)}")
                    if not _is_error_body(response):
                        ledger.violation("503_without_problem_body", method=request.method, path=request.url.path,
                                         content_type=response.headers.get("content-type"), body=response.text[:300])
                    if time.monotonic() > give_up or response.headers.get("x-should-retry") == "false":
                        return response  # (a chat whose job exists: a retry would start a second one)
                    response.close()
                    try:
                        wait = float(response.headers.get("retry-after", "1"))
                    except ValueError:
                        wait = 1.0
                    time.sleep(min(max(wait, 0.2), 5.0) * random.uniform(0.5, 1.0))
                    ledger.count("503_retried")

        return _Client(**kwargs)


def _route(path: str) -> str:
    return re.sub(r"/[0-9a-f]{32}|/(batch|file)_[A-Za-z0-9]+", "/ID", path)


def _is_error_body(response: Any) -> bool:
    """A problem body (``application/problem+json`` with a title and the status) or an OpenAI error body."""
    try:
        body = response.json()
    except ValueError:
        return False
    if not isinstance(body, dict):
        return False
    if response.headers.get("content-type", "").startswith("application/problem+json"):
        return body.get("status") == response.status_code and bool(body.get("title"))
    return isinstance(body.get("error"), dict) and bool(body["error"].get("message"))


class Tenant:
    """One tenant's client side: its key, an httpx client, an openai client, and the actions it takes."""

    def __init__(self, name: str, key: str, api: str, ledger: Ledger, hook_url: str, seed: str):
        from openai import OpenAI

        self.name, self.key, self.api, self.ledger, self.hook_url = name, key, api, ledger, hook_url
        self.rng = random.Random(seed)
        self.http = RetryingClient(ledger, base_url=api, headers={"Authorization": f"Bearer {key}"}, timeout=60)
        # through a client of its own that retries 503s as self.http does (a no-op unless services restart)
        self.openai = OpenAI(base_url=f"{api}/v1", api_key=key, max_retries=0, timeout=300,
                             http_client=RetryingClient(ledger, timeout=300))
        self.pending_batch_cancels: list[tuple[float, str]] = []
        self.others: list[Tenant] = []

    ACTIONS: tuple[tuple[int, str], ...] = (
        (26, "workflow_job"), (8, "planned_job"), (10, "chat"), (9, "chat_stream"), (6, "batch"), (10, "cancel"),
        (8, "replay"), (3, "events"), (6, "cross_tenant"), (2, "list_jobs"), (8, "response"),
    )
    RESPONSE_POLL_S = 300.0
    """How long a background response is polled before the soak calls it stuck."""

    def act(self) -> None:
        action = self.rng.choices([a for _, a in self.ACTIONS], weights=[w for w, _ in self.ACTIONS])[0]
        self.ledger.count(action)
        getattr(self, action)()
        now = time.monotonic()
        due = [b for t, b in self.pending_batch_cancels if t <= now]
        self.pending_batch_cancels = [(t, b) for t, b in self.pending_batch_cancels if t > now]
        for batch_id in due:
            r = self.http.post(f"/v1/batches/{batch_id}/cancel")
            self._expect(r, (200, 409), "batch_cancel", batch=batch_id)
            self.ledger.count("batch_cancel")

    def _expect(self, r: Any, ok: tuple[int, ...], what: str, **detail: Any) -> bool:
        if r.status_code in ok:
            if r.status_code >= 400:  # an answer the load accepts: counted with its title, for the report
                with contextlib.suppress(ValueError, AttributeError):
                    title = r.json().get("title") or r.json().get("error", {}).get("code")
                    self.ledger.count(f"{what} {r.status_code} {title}")
            return True
        if r.status_code == 429:  # in-flight quota: the soak's load outran the workers for a moment
            self.ledger.count(f"{what}_429")
            return False
        self.ledger.violation("unexpected_status", action=what, tenant=self.name, status=r.status_code,
                              body=r.text[:500], **detail)
        return False

    def _submit(self, body: dict[str, Any], kind: str, headers: dict[str, str] | None = None,
                **info: Any) -> str | None:
        r = self.http.post("/v1/jobs", json=body, headers=headers or {})
        if not self._expect(r, (202,), kind):
            return None
        job_id = str(r.json()["id"])
        self.ledger.job(job_id, self.name, kind, webhook="webhook_url" in body or self.name == DEFAULT_HOOK_TENANT,
                        **info)
        return job_id

    def workflow_job(self) -> None:
        rng = self.rng
        wf = random_workflow(rng, recursive=rng.random() < 0.15)
        body: dict[str, Any] = {"task": f"soak task {rng.randrange(10**9)}", "workflow": wf,
                                "metadata": {"soak": True, "tenant": self.name}}
        if rng.random() < 0.4:
            body["webhook_url"] = f"{self.hook_url}/{self.name}"
        roll = rng.random()
        if roll < 0.08:
            body["limits"] = {"max_tokens": rng.choice([40, 120, 400, 2000])}
        elif roll < 0.13:
            body["limits"] = {"max_cost_usd": rng.choice([0.00005, 0.0002, 0.002])}
        elif roll < 0.18:
            body["limits"] = {"deadline_s": rng.choice([0.5, 2, 5])}
        if rng.random() < 0.12:
            self._idempotent(body, len(wf["model_ids"]))
        else:
            self._submit(body, "workflow", steps=len(wf["model_ids"]))

    def _idempotent(self, body: dict[str, Any], steps: int) -> None:
        """The same key and body sent three times at once: one job, the others answer it."""
        headers = {"Idempotency-Key": f"soak-{self.rng.randrange(10**12)}"}
        answers: list[Any] = []

        def send() -> None:
            try:
                answers.append(self.http.post("/v1/jobs", json=body, headers=headers))
            except Exception as exc:
                answers.append(exc)

        senders = [threading.Thread(target=send) for _ in range(3)]
        for t in senders:
            t.start()
        for t in senders:
            t.join()
        ids = {a.json().get("id") for a in answers if not isinstance(a, Exception) and a.status_code in (200, 202)}
        statuses = sorted(str(a.status_code) if not isinstance(a, Exception) else type(a).__name__ for a in answers)
        if len(ids) != 1 or statuses.count("202") + statuses.count("200") != 3:
            self.ledger.violation("idempotency", tenant=self.name, ids=sorted(map(str, ids)), statuses=statuses,
                                  bodies=[a.text[:300] for a in answers if not isinstance(a, Exception)])
        for job_id in ids:
            self.ledger.job(job_id, self.name, "workflow", steps=steps,
                            webhook="webhook_url" in body or self.name == DEFAULT_HOOK_TENANT)

    def planned_job(self) -> None:
        planner = self.rng.choice(["planner-oa", "planner-oa", "template:fanout", "template:moa", "template:pev"])
        body = {"task": f"soak planned task {self.rng.randrange(10**9)}", "planner": planner}
        if self.rng.random() < 0.3:
            body["webhook_url"] = f"{self.hook_url}/{self.name}"
        self._submit(body, "planned", planner=planner)

    def _chat_model(self) -> str:
        return self.rng.choice(["conductor", "conductor/template:single", "conductor/planner-oa",
                                "conductor/template:pev"])

    def chat(self) -> None:
        import openai

        model = self._chat_model()
        messages: list[Any] = [{"role": "system", "content": "Be brief."},
                               {"role": "user", "content": f"soak chat {self.rng.randrange(10**9)}"}]
        record: dict[str, Any] = {"tenant": self.name, "stream": False, "model": model}
        try:
            reply = self.openai.chat.completions.create(model=model, messages=messages)
        except openai.APIStatusError as exc:
            job_id = exc.response.headers.get("conductor-job-id")
            record.update(job=job_id, status=exc.status_code, code=(exc.body or {}).get("code")
                          if isinstance(exc.body, dict) else None)
            accepted = (409, 500, 429, 503) if self.ledger.services_restart else (409, 500, 429)
            if exc.status_code not in accepted or (exc.status_code != 429 and not job_id):
                self.ledger.violation("chat_error", tenant=self.name, status=exc.status_code, job=job_id,
                                      message=str(exc)[:500])
        except openai.APIError as exc:
            self.ledger.violation("chat_error", tenant=self.name, message=f"{type(exc).__name__}: {exc}"[:500])
            return
        else:
            usage = reply.usage
            record.update(job=reply.id, status=200, content=reply.choices[0].message.content,
                          finish_reason=reply.choices[0].finish_reason,
                          prompt_tokens=usage.prompt_tokens if usage else None,
                          completion_tokens=usage.completion_tokens if usage else None)
        if record.get("job"):
            self.ledger.job(record["job"], self.name, "chat", webhook=self.name == DEFAULT_HOOK_TENANT)
        with self.ledger.lock:
            self.ledger.chats.append(record)

    def chat_stream(self) -> None:
        import openai

        model = self._chat_model()
        record: dict[str, Any] = {"tenant": self.name, "stream": True, "model": model}
        content: list[str] = []
        job_id = None
        finish = None
        usage = None
        try:
            stream = self.openai.chat.completions.create(
                model=model, stream=True, stream_options={"include_usage": True},
                messages=[{"role": "user", "content": f"soak stream {self.rng.randrange(10**9)}"}])
            for chunk in stream:
                job_id = job_id or chunk.id
                if chunk.usage is not None:
                    usage = chunk.usage
                for choice in chunk.choices:
                    if choice.delta.content:
                        content.append(choice.delta.content)
                    finish = choice.finish_reason or finish
            record.update(status=200)
        except openai.APIError as exc:
            record.update(status="error", error=str(exc)[:300])
        record.update(job=job_id, content="".join(content), finish_reason=finish,
                      prompt_tokens=usage.prompt_tokens if usage else None,
                      completion_tokens=usage.completion_tokens if usage else None)
        if job_id:
            self.ledger.job(job_id, self.name, "chat", webhook=self.name == DEFAULT_HOOK_TENANT)
        elif record["status"] == "error" and "rate" not in record.get("error", ""):
            self.ledger.violation("chat_stream_without_job", tenant=self.name, error=record.get("error"))
        with self.ledger.lock:
            self.ledger.chats.append(record)

    def response(self) -> None:
        """The Responses API through the SDK: waited for or in the background (then polled), half of them
        continuing one of this tenant's completed responses (``previous_response_id``)."""
        import openai

        rng = self.rng
        with self.ledger.lock:
            done = [r for r in self.ledger.responses if r["tenant"] == self.name and r.get("status") == "completed"]
        previous = rng.choice(done[-20:]) if done and rng.random() < 0.5 else None
        background = rng.random() < 0.5
        model = self._chat_model()
        record: dict[str, Any] = {"tenant": self.name, "model": model, "background": background,
                                  "previous": previous["job"] if previous else None}
        extra: dict[str, Any] = {"previous_response_id": previous["job"]} if previous else {}
        try:
            reply = self.openai.responses.create(model=model, input=f"soak response {rng.randrange(10**9)}",
                                                 instructions="Be brief.", background=background, **extra)
            deadline = time.monotonic() + self.RESPONSE_POLL_S
            while reply.status in ("queued", "in_progress") and time.monotonic() < deadline:
                time.sleep(0.5)
                reply = self.openai.responses.retrieve(reply.id)
        except openai.APIStatusError as exc:
            job_id = exc.response.headers.get("conductor-job-id")
            record.update(job=job_id, status=exc.status_code)
            accepted = (429, 503) if self.ledger.services_restart else (429,)
            if exc.status_code not in accepted:
                self.ledger.violation("response_error", tenant=self.name, status=exc.status_code, job=job_id,
                                      previous=record["previous"], message=str(exc)[:500])
        except openai.APIError as exc:
            self.ledger.violation("response_error", tenant=self.name, message=f"{type(exc).__name__}: {exc}"[:500])
            return
        else:
            usage = reply.usage
            record.update(job=reply.id, status=reply.status, content=reply.output_text,
                          echoed_previous=reply.previous_response_id,
                          input_tokens=usage.input_tokens if usage else None,
                          output_tokens=usage.output_tokens if usage else None)
            if reply.status in ("queued", "in_progress"):
                self.ledger.violation("response_stuck", tenant=self.name, job=reply.id, status=reply.status)
        if record.get("job"):
            self.ledger.job(record["job"], self.name, "response", webhook=self.name == DEFAULT_HOOK_TENANT)
        with self.ledger.lock:
            self.ledger.responses.append(record)

    def batch(self) -> None:
        rng = self.rng
        endpoint = rng.choice(["/v1/jobs", "/v1/chat/completions"])
        lines = []
        bad = 0
        for n in range(rng.randint(2, 8)):
            if endpoint == "/v1/jobs":
                body: dict[str, Any] = {"task": f"batch line {n}", "workflow": random_workflow(rng, recursive=False)}
            else:
                body = {"model": self._chat_model(), "messages": [{"role": "user", "content": f"batch q{n}"}]}
            if rng.random() < 0.1:  # refused alone: an agent the pool lacks / a model that does not exist
                bad += 1
                if endpoint == "/v1/jobs":
                    body["workflow"] = {"model_ids": ["nope"], "subtasks": ["x"], "access_lists": [[]]}
                else:
                    body["model"] = "conductor/nope"
            lines.append({"custom_id": f"c{n}", "method": "POST", "url": endpoint, "body": body})
        data = "\n".join(json.dumps(line) for line in lines).encode()
        r = self.http.post("/v1/files", files={"file": ("soak.jsonl", data)}, data={"purpose": "batch"})
        if not self._expect(r, (200,), "file_upload"):
            return
        file_id = r.json()["id"]
        with self.ledger.lock:
            self.ledger.files[file_id] = self.name
        r = self.http.post("/v1/batches", json={"input_file_id": file_id, "endpoint": endpoint,
                                                "completion_window": "24h"})
        if not self._expect(r, (200,), "batch_create"):
            return
        batch_id = r.json()["id"]
        with self.ledger.lock:
            self.ledger.batches[batch_id] = {"tenant": self.name, "lines": len(lines), "bad": bad}
        if rng.random() < 0.25:
            self.pending_batch_cancels.append((time.monotonic() + rng.uniform(0.5, 8), batch_id))

    def cancel(self) -> None:
        """Cancels one of the tenant's latest jobs, or one it submits now, a moment later (while it plans or
        runs its first steps)."""
        if self.rng.random() < 0.5:
            mine = self.ledger.mine(self.name, ("workflow", "planned", "replay"))[-8:]
            if not mine:
                return
            job_id: str | None = self.rng.choice(mine)[0]
        else:
            wf = random_workflow(self.rng, recursive=self.rng.random() < 0.3)
            body = {"task": "soak task to cancel", "workflow": wf, "webhook_url": f"{self.hook_url}/{self.name}"}
            job_id = self._submit(body, "workflow", steps=len(wf["model_ids"]))
            time.sleep(self.rng.uniform(0, 2))
        if job_id is None:
            return
        r = self.http.post(f"/v1/jobs/{job_id}/cancel")
        if self._expect(r, (202, 409), "cancel", job=job_id) and r.status_code == 202:
            with self.ledger.lock:
                self.ledger.jobs[job_id]["cancelled"] = True

    def replay(self) -> None:
        mine = self.ledger.mine(self.name, ("workflow", "planned", "replay", "chat"))[-60:]
        if not mine:
            return
        job_id, info = self.rng.choice(mine)
        body: dict[str, Any] = {}
        steps = info.get("steps")
        if steps and self.rng.random() < 0.7:
            body["from_step"] = self.rng.randrange(steps)
            if self.rng.random() < 0.3:
                body["agents"] = {str(body["from_step"]): self.rng.choice(STEP_AGENTS)}
        r = self.http.post(f"/v1/jobs/{job_id}/replay", json=body)
        # 409: still running (or never got a workflow); 422: an agents override on a recursive step
        if self._expect(r, (202, 409, 422), "replay", job=job_id, request=body) and r.status_code == 202:
            self.ledger.job(r.json()["id"], self.name, "replay", webhook=info.get("webhook", False), steps=steps,
                            replay_of=job_id)

    def events(self) -> None:
        mine = self.ledger.mine(self.name)[-20:]
        if not mine:
            return
        job_id, _ = self.rng.choice(mine)
        last_job_event = None
        try:
            with self.http.stream("GET", f"/v1/jobs/{job_id}/events", timeout=30) as r:
                if not self._expect(r, (200,), "events", job=job_id):
                    return
                deadline = time.monotonic() + 20
                event = None
                for line in r.iter_lines():
                    if line.startswith("event:"):
                        event = line.split(":", 1)[1].strip()
                    elif line.startswith("data:") and event == "job":
                        last_job_event = json.loads(line[5:])
                    elif line.startswith("data:") and event == "error":
                        if self.ledger.services_restart and "job_read_failed" in line:  # Postgres stayed away
                            self.ledger.count("events error job_read_failed")
                        else:
                            self.ledger.violation("event_stream_error", tenant=self.name, job=job_id, data=line)
                    if time.monotonic() > deadline:
                        break
        except Exception as exc:  # a read timeout while nothing changes
            self.ledger.count(f"events_{type(exc).__name__}")
        if last_job_event is not None and last_job_event.get("status") in TERMINAL:
            with self.ledger.lock:
                self.ledger.jobs.get(job_id, {}).setdefault("stream_end", last_job_event)

    def cross_tenant(self) -> None:
        if not self.others:
            return
        other = self.rng.choice(self.others)
        theirs = self.ledger.mine(other.name)
        if theirs:
            job_id, _ = self.rng.choice(theirs)
            for path in (f"/v1/jobs/{job_id}", f"/v1/jobs/{job_id}/steps", f"/v1/jobs/{job_id}/deliveries"):
                r = self.http.get(path)
                if r.status_code != 404:
                    self.ledger.violation("cross_tenant_read", reader=self.name, owner=other.name, path=path,
                                          status=r.status_code)
            r = self.http.post(f"/v1/jobs/{job_id}/cancel")
            if r.status_code != 404:
                self.ledger.violation("cross_tenant_cancel", reader=self.name, job=job_id, status=r.status_code)

    def list_jobs(self) -> None:
        r = self.http.get("/v1/jobs", params={"limit": 50})
        if not self._expect(r, (200,), "list"):
            return
        with self.ledger.lock:
            for job in r.json()["data"]:
                owner = self.ledger.jobs.get(job["id"], {}).get("tenant")
                if owner is not None and owner != self.name:
                    self.ledger.violation("cross_tenant_list", reader=self.name, job=job["id"], owner=owner)


def run_load(tenants: list[Tenant], stop: threading.Event, threads_per_tenant: int, pause_s: float,
             seed: int) -> list[threading.Thread]:
    """``threads_per_tenant`` threads per tenant, each taking an action, then waiting ``pause_s`` on average
    (exponentially distributed), until ``stop``."""

    def loop(tenant: Tenant, n: int) -> None:
        rng = random.Random(f"{seed}-{tenant.name}-{n}-pause")
        while not stop.is_set():
            try:
                tenant.act()
            except Exception as exc:  # a client-side error (connection refused while the API restarts, ...)
                tenant.ledger.count(f"client_error_{type(exc).__name__}")
                tenant.ledger.violation("client_exception", tenant=tenant.name,
                                        error=f"{type(exc).__name__}: {exc}"[:300])
            stop.wait(rng.expovariate(1 / pause_s))

    threads = []
    for tenant in tenants:
        for n in range(threads_per_tenant):
            # each thread its own Tenant clients (httpx and openai clients are thread-safe; the rng is not)
            clone = Tenant(tenant.name, tenant.key, tenant.api, tenant.ledger, tenant.hook_url,
                           seed=f"{seed}-{tenant.name}-{n}")
            clone.others = tenant.others
            t = threading.Thread(target=loop, args=(clone, n), name=f"load-{tenant.name}-{n}", daemon=True)
            t.start()
            threads.append(t)
    return threads


def chaos(workers: list[Proc], stop: threading.Event, rng: random.Random, log: Callable[[str], None],
          every: tuple[float, float], guard: threading.Lock) -> None:
    """SIGKILLs one worker process every ``every`` seconds (uniform) and starts it again a moment later."""
    while not stop.wait(rng.uniform(*every)):
        victim = rng.choice(workers)
        with guard:
            victim.kill()
            log(f"chaos: SIGKILLed {victim.name} (incarnation {victim.incarnation})")
            time.sleep(rng.uniform(1, 5))
            victim.start()
        try:
            victim.wait_for_log("ready.")
        except RuntimeError as exc:
            log(f"chaos: {victim.name} did not come back: {exc}")
        log(f"chaos: restarted {victim.name} (incarnation {victim.incarnation})")


# --- service chaos: Postgres and Redis restarted under the load ------------------------------------------------

SERVICE_FAULTS = ("pg_fast", "pg_immediate", "redis_saved", "redis_lost", "both")
"""Postgres stopped fast (a checkpoint, sessions ended) or immediate (crash recovery); Redis shut down with
a save (its messages come back) or SIGKILLed (``--save ""``: the broker's queues are lost); both at once
(Postgres immediate, Redis lost)."""
SERVICE_DOWN_S = (3.0, 15.0)
"""How long a restarted service stays down by default (uniform; --down-min/--down-max): long enough for the
probe and the load to meet it, and past the soak's step lease (6 s)."""
RECOVERY_BOUND_S = 60.0
"""After a service is back, the API must answer a submission (202) within this long (its pooled connections
probed and replaced); else ``api_not_recovered``."""


@dataclass
class Outages:
    """What is down now, and what the service chaos did (for the report)."""

    pg_down: threading.Event = field(default_factory=threading.Event)
    redis_down: threading.Event = field(default_factory=threading.Event)
    done: list[dict[str, Any]] = field(default_factory=list)
    probes: Counter[str] = field(default_factory=Counter)
    lock: threading.Lock = field(default_factory=threading.Lock)


def service_chaos(services: tuple[Any, Any], outages: Outages, stop: threading.Event, rng: random.Random,
                  log: Callable[[str], None], every: tuple[float, float],
                  down: tuple[float, float] = SERVICE_DOWN_S) -> None:
    """Every ``every`` seconds (uniform) one fault of SERVICE_FAULTS, each in turn in a shuffled order (so a
    run of five or more faults has them all): the service(s) stopped, down ``down`` seconds, started again."""
    pg, redis_server = services
    order: list[str] = []
    while not stop.wait(rng.uniform(*every)):
        if not order:
            order = list(SERVICE_FAULTS)
            rng.shuffle(order)
        fault = order.pop()
        down_s = rng.uniform(*down)
        began = time.monotonic()
        if fault in ("pg_fast", "pg_immediate", "both"):
            outages.pg_down.set()
            pg.stop("fast" if fault == "pg_fast" else "immediate")
        if fault in ("redis_saved", "redis_lost", "both"):
            outages.redis_down.set()
            redis_server.stop(save=fault == "redis_saved")
        log(f"service chaos: {fault}: down for {down_s:.1f}s")
        time.sleep(down_s)
        if outages.redis_down.is_set():
            redis_server.start(keep_data=fault == "redis_saved")
            outages.redis_down.clear()
        if outages.pg_down.is_set():
            pg.start()
            outages.pg_down.clear()
        with outages.lock:
            outages.done.append({"fault": fault, "down_s": round(time.monotonic() - began, 1)})
        log(f"service chaos: {fault}: back after {time.monotonic() - began:.1f}s")


PROBES: tuple[tuple[str, str, Any, bool], ...] = (
    ("GET", "/healthz", None, False), ("GET", "/v1/jobs", None, False), ("POST", "/v1/jobs", "job", False),
    ("GET", "/v1/models", None, False), ("GET", "/metrics", None, False), ("GET", "/v1/batches", None, False),
    ("POST", "/v1/chat/completions", {"model": "conductor/template:single",
                                      "messages": [{"role": "user", "content": "soak outage probe"}]}, True),
)
"""What the outage probe sends each second while a service is down (``"job"``: a one-step workflow job); the
last field: only while Postgres is down (a chat completion waits for its job, which a Redis outage delays)."""


def probe_outages(api: str, key: str, outages: Outages, ledger: Ledger, stop: threading.Event,
                  log: Callable[[str], None]) -> None:
    """While Postgres is down, the API answers 503 with a problem body (never a 500); while Redis is down it
    still accepts submissions (202: the reconciler sends them later); once a service is back, a submission
    is accepted within RECOVERY_BOUND_S. One request of each kind a second, without retries."""
    import httpx

    http = httpx.Client(base_url=api, headers={"Authorization": f"Bearer {key}"}, timeout=30)
    body = {"task": "soak outage probe", "workflow": {"model_ids": ["sim-a"], "subtasks": ["probe"],
                                                      "access_lists": [[]]}}
    was_down: str | None = None
    while not stop.wait(1.0):
        pg_down, redis_down = outages.pg_down.is_set(), outages.redis_down.is_set()
        if pg_down or redis_down:
            was_down = "postgres" if pg_down else "redis"
            for method, path, sent, pg_only in PROBES:
                if pg_only and not pg_down:
                    continue
                try:
                    headers = {"Authorization": f"Bearer {METRICS_TOKEN}"} if path == "/metrics" else {}
                    r = http.request(method, path, json=body if sent == "job" else sent, headers=headers)
                except httpx.HTTPError as exc:
                    ledger.violation("probe_no_answer", down=was_down, method=method, path=path,
                                     error=f"{type(exc).__name__}: {exc}"[:300])
                    continue
                with outages.lock:
                    outages.probes[f"{was_down} down: {method} {path} {r.status_code}"] += 1
                if r.status_code == 202 and sent == "job":
                    ledger.job(r.json()["id"], "soak-a", "workflow", steps=1, probe=True, webhook=False)
                if pg_down and r.status_code == 503:
                    if not _is_error_body(r):
                        ledger.violation("503_without_problem_body", down="postgres", method=method, path=path,
                                         content_type=r.headers.get("content-type"), body=r.text[:300])
                    elif "retry-after" not in r.headers:
                        ledger.violation("503_without_retry_after", method=method, path=path)
                elif r.status_code >= 500 or (redis_down and not pg_down and sent == "job"
                                              and r.status_code != 202):
                    ledger.violation("probe_unexpected_status", down=was_down, method=method, path=path,
                                     status=r.status_code, body=r.text[:500])
        elif was_down is not None:
            back = time.monotonic()
            while True:
                try:
                    r = http.post("/v1/jobs", json=body)
                    if r.status_code == 202:
                        ledger.job(r.json()["id"], "soak-a", "workflow", steps=1, probe=True, webhook=False)
                        break
                    status: Any = r.status_code
                except httpx.HTTPError as exc:
                    status = type(exc).__name__
                if time.monotonic() - back > RECOVERY_BOUND_S:
                    ledger.violation("api_not_recovered", after=was_down, last=status)
                    break
                time.sleep(0.5)
            with outages.lock:
                outages.probes[f"recovered after {was_down}: first 202 within {int(time.monotonic() - back) + 1}s"] += 1
            was_down = None


def watch_processes(procs: list[Proc], guard: threading.Lock, ledger: Ledger, stop: threading.Event,
                    log: Callable[[str], None]) -> None:
    """A process that exits unasked (the API, beat, a worker's supervisor) is a violation; it is started again
    so that the run goes on. ``guard`` is held by the worker chaos while it kills and restarts one."""
    while not stop.wait(2.0):
        with guard:
            for proc in procs:
                assert proc.popen is not None
                code = proc.popen.poll()
                if code is not None:
                    ledger.violation("process_exited", process=proc.name, code=code, log=str(proc.log_paths[-1]))
                    log(f"watchdog: {proc.name} exited with code {code}; starting it again")
                    proc.start()


# --- the checks ------------------------------------------------------------------------------------------------


CHECKED: Counter[str] = Counter()
"""How many items each check looked at (a check that saw nothing proves nothing)."""


def q(sql: str, **params: Any) -> list[Any]:
    import sqlalchemy as sa

    from conductor.store.db import get_engine

    with get_engine().connect() as conn:
        return list(conn.execute(sa.text(sql), params))


def wait_until(what: str, done: Callable[[], int], timeout: float, log: Callable[[str], None]) -> int:
    """Polls ``done`` (how many are left) until 0 or ``timeout``; returns what was left."""
    deadline = time.monotonic() + timeout
    left = done()
    while left and time.monotonic() < deadline:
        time.sleep(2)
        left = done()
    log(f"drain: {what}: {left} left")
    return left


def check_jobs(v: Callable[..., None]) -> None:
    for row in q("SELECT id, tenant, status, parent_job_id FROM job "
                 "WHERE status NOT IN ('succeeded','failed','cancelled')"):
        v("job_not_ended", job=row.id, tenant=row.tenant, status=row.status, parent=row.parent_job_id)
    for row in q("""SELECT j.id, j.status AS job_status, s.index, s.status FROM step s JOIN job j ON j.id = s.job_id
                    WHERE j.status IN ('succeeded','failed','cancelled')
                      AND s.status IN ('pending','queued','running')"""):
        v("open_step_on_ended_job", job=row.id, job_status=row.job_status, step=row.index, status=row.status)
    for row in q("""SELECT j.id, s.index, s.status FROM step s JOIN job j ON j.id = s.job_id
                    WHERE j.status = 'succeeded' AND s.status <> 'succeeded'"""):
        v("succeeded_job_with_unsucceeded_step", job=row.id, step=row.index, status=row.status)


def check_usage(v: Callable[..., None]) -> None:
    rows = q("""SELECT j.id, j.status, j.input_tokens, j.output_tokens, j.cost_usd, j.calls,
                       j.planner_input_tokens + COALESCE(SUM(s.input_tokens), 0) AS in_sum,
                       j.planner_output_tokens + COALESCE(SUM(s.output_tokens), 0) AS out_sum,
                       j.planner_cost_usd + COALESCE(SUM(s.cost_usd), 0) AS cost_sum,
                       j.planner_calls + COALESCE(SUM(s.attempts) FILTER (WHERE s.agent <> 'conductor'), 0) AS calls_sum
                FROM job j LEFT JOIN step s ON s.job_id = j.id
                WHERE j.status IN ('succeeded','failed','cancelled') GROUP BY j.id""")
    CHECKED["job usage"] += len(rows)
    for r in rows:
        if (r.input_tokens, r.output_tokens, r.calls) != (r.in_sum, r.out_sum, r.calls_sum) or \
                abs(r.cost_usd - r.cost_sum) > 1e-9:
            v("job_usage_not_its_parts", job=r.id, status=r.status,
              job_usage=[r.input_tokens, r.output_tokens, round(r.cost_usd, 12), r.calls],
              parts=[int(r.in_sum), int(r.out_sum), round(r.cost_sum, 12), int(r.calls_sum)])
    for r in q("""SELECT s.job_id, s.index, s.input_tokens, s.output_tokens, c.id AS child, c.input_tokens AS c_in,
                         c.output_tokens AS c_out, c.status AS c_status
                  FROM step s JOIN job c ON c.id = s.child_job_id
                  WHERE c.status IN ('succeeded','failed','cancelled')
                    AND (s.input_tokens, s.output_tokens) <> (c.input_tokens, c.output_tokens)"""):
        v("recursive_step_usage_not_its_child", job=r.job_id, step=r.index, child=r.child, child_status=r.c_status,
          step_usage=[r.input_tokens, r.output_tokens], child_usage=[r.c_in, r.c_out])


def check_budgets(v: Callable[..., None]) -> None:
    """A job with a token or cost budget spent no more (the fake provider counts words, fewer than the
    engine's estimate of four characters a token, and cuts its answers at ``max_tokens`` as a model does)."""
    for r in q("""SELECT id, parent_job_id, status, error_type, input_tokens + output_tokens AS tokens, cost_usd,
                         (limits->>'max_tokens')::bigint AS max_tokens, (limits->>'max_cost_usd')::float AS max_cost
                  FROM job WHERE limits ? 'max_tokens' AND limits->>'max_tokens' IS NOT NULL
                     OR limits ? 'max_cost_usd' AND limits->>'max_cost_usd' IS NOT NULL"""):
        if (r.max_tokens is not None and r.tokens > r.max_tokens) or (r.max_cost is not None and
                                                                      r.cost_usd > r.max_cost * (1 + 1e-9)):
            v("budget_overspent", job=r.id, parent=r.parent_job_id, status=r.status, error=r.error_type,
              tokens=[r.tokens, r.max_tokens], cost=[r.cost_usd, r.max_cost])


def check_attempts(v: Callable[..., None]) -> None:
    for r in q("""SELECT s.job_id, s.index, count(*) AS ok FROM step_attempt a JOIN step s ON s.id = a.step_id
                  WHERE a.error_type IS NULL AND a.finished_at IS NOT NULL
                  GROUP BY s.job_id, s.index HAVING count(*) > 1"""):
        v("step_succeeded_twice", job=r.job_id, step=r.index, successful_attempts=r.ok)
    for r in q("""SELECT s.job_id, s.index, s.attempts,
                         count(a.id) FILTER (WHERE a.error_type IS NULL AND a.finished_at IS NOT NULL) AS ok
                  FROM step s LEFT JOIN step_attempt a ON a.step_id = s.id
                  WHERE s.status = 'succeeded' AND s.reused_from IS NULL AND s.agent <> 'conductor'
                  GROUP BY s.id
                  HAVING count(a.id) FILTER (WHERE a.error_type IS NULL AND a.finished_at IS NOT NULL) <> 1"""):
        v("succeeded_step_without_one_successful_attempt", job=r.job_id, step=r.index, successful_attempts=r.ok)
    for r in q("""SELECT s.job_id, s.index, s.attempts, array_agg(a.n ORDER BY a.n) AS ns
                  FROM step s JOIN step_attempt a ON a.step_id = s.id GROUP BY s.id
                  HAVING min(a.n) <> 1 OR max(a.n) <> count(*) OR count(DISTINCT a.n) <> count(*)
                      OR max(a.n) <> s.attempts"""):
        v("attempt_numbers_not_1_to_n", job=r.job_id, step=r.index, attempts=r.attempts, numbers=list(r.ns))
    for r in q("""SELECT s.job_id, s.index, s.status, j.status AS job_status, a.n, a.worker, a.started_at
                  FROM step_attempt a JOIN step s ON s.id = a.step_id JOIN job j ON j.id = s.job_id
                  WHERE a.finished_at IS NULL AND j.status IN ('succeeded','failed','cancelled')"""):
        v("open_attempt_on_ended_job", job=r.job_id, step=r.index, step_status=r.status, job_status=r.job_status,
          attempt=r.n, worker=r.worker, started_at=str(r.started_at))


def check_webhooks(v: Callable[..., None], hooks: Hooks) -> None:
    for r in q("""SELECT j.id, j.status FROM job j LEFT JOIN webhook_delivery d ON d.job_id = j.id
                  WHERE j.parent_job_id IS NULL AND j.webhook_url IS NOT NULL
                    AND j.status IN ('succeeded','failed','cancelled') AND d.id IS NULL"""):
        v("ended_job_without_delivery", job=r.id, status=r.status)
    for r in q("""SELECT d.id, d.job_id, d.status, d.event_type, d.attempts, j.status AS job_status
                  FROM webhook_delivery d JOIN job j ON j.id = d.job_id"""):
        if r.status == "pending":
            v("delivery_not_ended", delivery=r.id, job=r.job_id, attempts=r.attempts)
        if r.event_type != f"job.{r.job_status}":
            v("delivery_type_not_the_job_status", delivery=r.id, job=r.job_id, type=r.event_type, status=r.job_status)
        CHECKED["deliveries"] += 1
        with hooks.lock:
            bodies = hooks.bodies.get(r.id, set())
            answers = hooks.answers.get(r.id, [])
        if r.status == "delivered" and 200 not in answers:
            v("delivered_but_never_answered_2xx", delivery=r.id, job=r.job_id, answers=answers)
        if len(bodies) > 1:
            v("delivery_bodies_differ", delivery=r.id, job=r.job_id, bodies=len(bodies))


def check_batches(v: Callable[..., None], ledger: Ledger, clients: dict[str, Any]) -> None:
    for batch_id, info in ledger.batches.items():
        http = clients[info["tenant"]]
        CHECKED["batches"] += 1
        b = http.get(f"/v1/batches/{batch_id}").json()
        counts = b.get("request_counts") or {}
        lines = q("""SELECT r.line, r.error_code, j.status FROM batch_request r LEFT JOIN job j ON j.id = r.job_id
                     WHERE r.batch_id = :b""", b=batch_id)
        succeeded = sum(1 for r in lines if r.status == "succeeded")
        failed = sum(1 for r in lines if r.error_code is not None or r.status in ("failed", "cancelled"))
        expect = {"total": info["lines"], "completed": succeeded, "failed": failed}
        got = {k: counts.get(k) for k in expect}
        if b.get("status") not in ("completed", "cancelled", "expired"):
            v("batch_not_ended", batch=batch_id, status=b.get("status"), counts=counts)
        if got != expect or len(lines) != info["lines"]:
            v("batch_counts_not_its_lines", batch=batch_id, status=b.get("status"), api=got, rows=expect,
              rows_stored=len(lines))
        for name, want in (("output_file_id", succeeded), ("error_file_id", failed)):
            file_id = b.get(name)
            if file_id is None:
                if want:
                    v("batch_file_missing", batch=batch_id, file=name, lines_expected=want)
                continue
            content = http.get(f"/v1/files/{file_id}/content")
            n = len([line for line in content.text.splitlines() if line.strip()])
            if n != want:
                v("batch_file_lines", batch=batch_id, file=name, lines=n, expected=want)


def scrape(http: Any, token: str | None = None) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    from prometheus_client.parser import text_string_to_metric_families

    headers = {"Authorization": f"Bearer {token}"} if token else {}
    text = http.get("/metrics", headers=headers).text
    out: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return out


def expected_metrics(tenant: str | None = None) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """The store-derived series of /metrics, computed from the rows directly (not through the rollup)."""
    where = "" if tenant is None else "WHERE j.tenant = :t"
    t = {"t": tenant} if tenant else {}
    out: dict[tuple[str, tuple[tuple[str, str], ...]], float] = defaultdict(float)

    def put(name: str, value: float, **labels: str) -> None:
        out[(name, tuple(sorted(labels.items())))] += float(value)

    for r in q(f"SELECT j.tenant, j.status, count(*) AS n FROM job j {where} GROUP BY 1, 2", **t):
        put("conductor_jobs", r.n, tenant=r.tenant, status=r.status)
        put("conductor_jobs_created_total", r.n, tenant=r.tenant)
    for r in q(f"""SELECT j.tenant, j.planner, sum(j.planner_input_tokens) AS i, sum(j.planner_output_tokens) AS o,
                          sum(j.planner_cost_usd) AS c, sum(j.plan_resends) AS resends,
                          sum(GREATEST(j.plan_claims - 1, 0)) AS redrives FROM job j {where} GROUP BY 1, 2""", **t):
        put("conductor_tokens_total", r.i, tenant=r.tenant, role="planner", agent=r.planner, direction="input")
        put("conductor_tokens_total", r.o, tenant=r.tenant, role="planner", agent=r.planner, direction="output")
        put("conductor_cost_usd_total", r.c, tenant=r.tenant, role="planner", agent=r.planner)
        put("conductor_reconciler_actions_total", r.resends, tenant=r.tenant, action="plan")
        put("conductor_reconciler_actions_total", r.redrives, tenant=r.tenant, action="planning_redrive")
    for r in q(f"""SELECT j.tenant, s.agent, s.status, count(*) AS n, sum(s.input_tokens) AS i,
                          sum(s.output_tokens) AS o, sum(s.cost_usd) AS c, sum(GREATEST(s.attempts - 1, 0)) AS retries,
                          sum(s.resends) AS resends
                   FROM step s JOIN job j ON j.id = s.job_id {where} GROUP BY 1, 2, 3""", **t):
        put("conductor_steps", r.n, tenant=r.tenant, agent=r.agent, status=r.status)
        put("conductor_reconciler_actions_total", r.resends, tenant=r.tenant, action="step")
        if r.agent == "conductor":
            continue
        put("conductor_tokens_total", r.i, tenant=r.tenant, role="worker", agent=r.agent, direction="input")
        put("conductor_tokens_total", r.o, tenant=r.tenant, role="worker", agent=r.agent, direction="output")
        put("conductor_cost_usd_total", r.c, tenant=r.tenant, role="worker", agent=r.agent)
        put("conductor_step_retries_total", r.retries, tenant=r.tenant, agent=r.agent)
    for r in q(f"""SELECT s.agent, count(s.latency_ms) AS n, sum(s.latency_ms) AS ms
                   FROM step s JOIN job j ON j.id = s.job_id {where + ' AND' if where else 'WHERE'}
                   s.agent <> 'conductor' GROUP BY 1 HAVING count(s.latency_ms) > 0""", **t):
        put("conductor_step_latency_seconds_count", r.n, agent=r.agent)
        put("conductor_step_latency_seconds_sum", r.ms / 1000, agent=r.agent)
    for r in q(f"""SELECT j.tenant, s.agent, COALESCE(a.error_type, 'ok') AS outcome, count(*) AS n
                   FROM step_attempt a JOIN step s ON s.id = a.step_id JOIN job j ON j.id = s.job_id
                   {where + ' AND' if where else 'WHERE'} a.finished_at IS NOT NULL GROUP BY 1, 2, 3""", **t):
        put("conductor_step_attempts_total", r.n, tenant=r.tenant, agent=r.agent, outcome=r.outcome)
    dwhere = "" if tenant is None else "WHERE d.tenant = :t"
    for r in q(f"SELECT d.tenant, d.status, count(*) AS n FROM webhook_delivery d {dwhere} GROUP BY 1, 2", **t):
        put("conductor_webhook_deliveries", r.n, tenant=r.tenant, status=r.status)
    for r in q(f"""SELECT d.tenant,
                          CASE WHEN a.status_code IS NULL THEN 'error' ELSE (a.status_code / 100)::text || 'xx' END
                          AS outcome, count(*) AS n
                   FROM webhook_attempt a JOIN webhook_delivery d ON d.id = a.delivery_id
                   {dwhere + ' AND' if dwhere else 'WHERE'} a.finished_at IS NOT NULL GROUP BY 1, 2""", **t):
        put("conductor_webhook_attempts_total", r.n, tenant=r.tenant, outcome=r.outcome)
    return out


COMPARED = ("conductor_jobs", "conductor_jobs_created_total", "conductor_steps", "conductor_tokens_total",
            "conductor_cost_usd_total", "conductor_step_retries_total", "conductor_step_attempts_total",
            "conductor_reconciler_actions_total", "conductor_webhook_deliveries", "conductor_webhook_attempts_total",
            "conductor_step_latency_seconds_count", "conductor_step_latency_seconds_sum")


def check_metrics(v: Callable[..., None], http: Any, keys: dict[str, str]) -> None:
    views: list[tuple[str, str | None, str]] = [("all", None, METRICS_TOKEN)]
    views += [(tenant, tenant, key) for tenant, key in keys.items()]
    for view, tenant, token in views:
        got = {k: val for k, val in scrape(http, token).items() if k[0] in COMPARED}
        want = {k: val for k, val in expected_metrics(tenant).items()}
        for key in sorted(set(got) | set(want)):
            CHECKED["metrics samples"] += 1
            a, b = got.get(key, 0.0), want.get(key, 0.0)
            if abs(a - b) > max(1e-6, 1e-9 * abs(b)):
                v("metrics_not_the_rows", view=view, series=key[0], labels=dict(key[1]), metrics=a, rows=b)


def check_isolation(v: Callable[..., None], ledger: Ledger, clients: dict[str, Any]) -> None:
    """Every job (child jobs too), batch and file of each tenant, read with each other tenant's key: 404."""
    owners = {r.id: r.tenant for r in q("SELECT id, tenant FROM job")}
    for job_id, owner in owners.items():
        for tenant, http in clients.items():
            if tenant == owner:
                continue
            CHECKED["cross-tenant job reads"] += 1
            r = http.get(f"/v1/jobs/{job_id}")
            if r.status_code != 404:
                v("cross_tenant_read", job=job_id, owner=owner, reader=tenant, status=r.status_code)
    for batch_id, info in ledger.batches.items():
        for tenant, http in clients.items():
            if tenant != info["tenant"] and http.get(f"/v1/batches/{batch_id}").status_code != 404:
                v("cross_tenant_batch_read", batch=batch_id, owner=info["tenant"], reader=tenant)
    for file_id, owner in ledger.files.items():
        for tenant, http in clients.items():
            if tenant != owner and http.get(f"/v1/files/{file_id}/content").status_code != 404:
                v("cross_tenant_file_read", file=file_id, owner=owner, reader=tenant)
    for tenant, http in clients.items():  # a page of the list holds only the tenant's own
        for job in http.get("/v1/jobs", params={"limit": 200}).json().get("data", []):
            if owners.get(job["id"]) != tenant:
                v("cross_tenant_list", job=job["id"], owner=owners.get(job["id"]), reader=tenant)


def check_chats(v: Callable[..., None], ledger: Ledger) -> None:
    jobs = {r.id: r for r in q("SELECT id, status, answer, input_tokens, output_tokens FROM job "
                               "WHERE parent_job_id IS NULL")}
    for chat in ledger.chats:
        job = jobs.get(chat.get("job") or "")
        if job is None:
            continue
        CHECKED[f"chats ({'stream' if chat['stream'] else 'plain'}, {chat['status']})"] += 1
        if chat["status"] == 200:
            if job.status != "succeeded" or (chat.get("content") or "") != (job.answer or ""):
                v("chat_answer_not_the_job", job=job.id, stream=chat["stream"], job_status=job.status,
                  content=(chat.get("content") or "")[:120], answer=(job.answer or "")[:120])
            if chat.get("prompt_tokens") is not None and (chat["prompt_tokens"], chat["completion_tokens"]) != (
                    job.input_tokens, job.output_tokens):
                v("chat_usage_not_the_job", job=job.id, stream=chat["stream"],
                  chat=[chat["prompt_tokens"], chat["completion_tokens"]], rows=[job.input_tokens, job.output_tokens])
        elif (chat["status"], job.status) in ((409, "succeeded"), (409, "failed"), (500, "succeeded"),
                                              (500, "cancelled")):
            v("chat_error_not_the_job_status", job=job.id, status=chat["status"], job_status=job.status)
    for job_id, info in ledger.jobs.items():
        end = info.get("stream_end")
        job = jobs.get(job_id)
        CHECKED["event streams to the end"] += end is not None
        if end is not None and job is not None and end.get("status") != job.status:
            v("event_stream_end_not_the_job", job=job_id, event=end, status=job.status)


def check_responses(v: Callable[..., None], ledger: Ledger) -> None:
    """A response's answer and usage are its job's; a continued one echoes what it continued, and its job's
    context holds that response's answer (the worker saw the earlier turn)."""
    jobs = {r.id: r for r in q("SELECT id, status, answer, input_tokens, output_tokens, context::text AS context "
                               "FROM job WHERE parent_job_id IS NULL")}
    answers = {r["job"]: r.get("content") for r in ledger.responses if r.get("status") == "completed"}
    for resp in ledger.responses:
        job = jobs.get(resp.get("job") or "")
        if job is None:
            continue
        CHECKED[f"responses ({'continued' if resp['previous'] else 'new'}, {resp['status']})"] += 1
        expected = {"completed": "succeeded", "incomplete": "succeeded", "failed": "failed", "cancelled": "cancelled"}
        if resp["status"] in expected and job.status != expected[resp["status"]]:
            v("response_status_not_the_job", job=job.id, response=resp["status"], job_status=job.status)
        if resp["status"] != "completed":
            continue
        if (resp.get("content") or "") != (job.answer or ""):
            v("response_answer_not_the_job", job=job.id, content=(resp.get("content") or "")[:120],
              answer=(job.answer or "")[:120])
        if resp.get("input_tokens") is not None and (resp["input_tokens"], resp["output_tokens"]) != (
                job.input_tokens, job.output_tokens):
            v("response_usage_not_the_job", job=job.id, response=[resp["input_tokens"], resp["output_tokens"]],
              rows=[job.input_tokens, job.output_tokens])
        if resp["previous"]:
            earlier = answers.get(resp["previous"])
            if resp.get("echoed_previous") != resp["previous"]:
                v("response_previous_not_echoed", job=job.id, previous=resp["previous"],
                  echoed=resp.get("echoed_previous"))
            if earlier and json.dumps(earlier, ensure_ascii=False)[1:-1] not in (job.context or ""):
                v("response_previous_not_in_context", job=job.id, previous=resp["previous"])


TRACEBACK = re.compile(r"Traceback \(most recent call last\)|Exception ignored in| ERROR/|^ERROR|CRITICAL")
"""A traceback (also one Celery's stderr redirect logs line by line as WARNING), or an error logged."""


OUTAGE = re.compile(
    r"OperationalError|InterfaceError|DisconnectionError|ConnectionRefusedError|ConnectionResetError|"
    r"redis\.exceptions\.(ConnectionError|TimeoutError|BusyLoadingError)|Connection refused|"
    r"Cannot connect to redis|Connection to broker lost|server closed the connection|terminating connection|"
    r"the database system is (starting up|shutting down|in recovery mode)|Connection closed by server|"
    r"Error while reading from|consumer: Connection to broker lost|Unrecoverable error|"
    r"BrokenPipeError|Error \d+ connecting to 127\.0\.0\.1|"
    # kombu's Redis transport closing a channel whose connection is gone (docs/architecture.md, Worker supervision)
    r"object has no attribute '(hostname|connection_errors)'")
"""A log error whose context names a lost Postgres or Redis connection: expected while --service-chaos has
one down, counted in the report (``outage_log_errors``) rather than a violation. The rows' checks judge
whether the service recovered from it."""


OUTAGE_WINDOW = (40, 60)
"""Lines before and after a log error searched for OUTAGE."""


def check_logs(v: Callable[..., None], procs: list[Proc], outage_errors: Counter[str] | None = None) -> None:
    """Every log error is a violation, or with ``outage_errors`` (service chaos) one whose context names a
    lost connection is counted there by its first line (ids and numbers blanked)."""
    for proc in procs:
        for path in proc.log_paths:
            text = path.read_text(errors="replace")
            lines = text.splitlines()
            for i, line in enumerate(lines):
                if TRACEBACK.search(line):
                    context = "\n".join(lines[max(0, i - 3): i + 25])
                    # the traceback around it, each exception of its chain (Celery's stderr redirect logs a
                    # traceback line by line, so a log record is not a boundary)
                    record = "\n".join(lines[max(0, i - OUTAGE_WINDOW[0]): i + OUTAGE_WINDOW[1]])
                    if outage_errors is not None and OUTAGE.search(record):
                        first = re.sub(r"[0-9a-f]{32}|\d+(\.\d+)?", "N", line.split("]", 1)[-1]).strip()
                        outage_errors[f"{proc.name}: {first[:160]}"] += 1
                        continue
                    v("log_error", log=str(path), line=i + 1, context=context)


def warnings_seen(procs: list[Proc]) -> dict[str, int]:
    """The logs' WARNING lines, ids blanked, counted (the 20 most frequent): for the report, not a check."""
    seen: Counter[str] = Counter()
    for proc in procs:
        for path in proc.log_paths:
            for line in path.read_text(errors="replace").splitlines():
                if "WARNING/" in line or " WARNING " in line:
                    text = re.sub(r"[0-9a-f]{32}", "ID", line.split("]", 1)[-1]).strip()
                    seen[re.sub(r"\d+(\.\d+)?", "N", text)[:160]] += 1
    return dict(seen.most_common(20))


# --- main ------------------------------------------------------------------------------------------------------


def prepare(args: argparse.Namespace) -> None:
    import redis
    import sqlalchemy as sa

    from conductor.migrations.migrate import upgrade
    from conductor.store.db import get_engine

    url = sa.make_url(args.database_url)
    admin = sa.create_engine(url.set(database="postgres"), isolation_level="AUTOCOMMIT", poolclass=sa.NullPool)
    with admin.connect() as conn:
        if conn.execute(sa.text("SELECT 1 FROM pg_database WHERE datname = :n"), {"n": url.database}).first() is None:
            conn.execute(sa.text(f'CREATE DATABASE "{url.database}"'))
    admin.dispose()
    upgrade(args.database_url)

    with get_engine().begin() as conn:
        tables = [r[0] for r in conn.execute(sa.text(
            "SELECT tablename FROM pg_tables WHERE schemaname = 'public' AND tablename <> 'alembic_version'"))]
        conn.execute(sa.text(f"TRUNCATE {', '.join(tables)} RESTART IDENTITY CASCADE"))
    for url in (args.broker_url, args.result_backend):
        redis.Redis.from_url(url).flushdb()


def soak_main(args: argparse.Namespace) -> int:
    workdir = Path(args.workdir or f"/tmp/conductor-soak-{time.strftime('%Y%m%d-%H%M%S')}")
    logs = workdir / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    (workdir / "data").mkdir(exist_ok=True)
    started = time.monotonic()
    progress = (workdir / "progress.log").open("a")

    def log(msg: str) -> None:
        line = f"[{time.monotonic() - started:7.1f}s] {msg}"
        print(line, flush=True)
        progress.write(line + "\n")
        progress.flush()

    services: tuple[Any, Any] | None = None
    if args.service_chaos:  # a cluster and a Redis of the soak's own, which it restarts
        from bench.services import PrivatePostgres, PrivateRedis

        pg, redis_server = PrivatePostgres(workdir, args.pg_port), PrivateRedis(workdir, args.redis_port)
        pg.init()
        pg.start()
        redis_server.start(keep_data=False)
        services = (pg, redis_server)
        import atexit

        def stop_services() -> None:  # also when the soak fails
            redis_server.stop(save=False)
            pg.stop("immediate")

        atexit.register(stop_services)
        args.database_url = pg.url("conductor_soak")
        args.broker_url, args.result_backend = redis_server.url(0), redis_server.url(1)
        log(f"services: Postgres {args.database_url} (cluster {pg.data}), Redis {args.broker_url}")
    env = soak_env(args, workdir)
    os.environ.update({k: v for k, v in env.items() if k.startswith("CONDUCTOR_") or k == ANTHROPIC_KEY_ENV})
    from conductor.settings import get_settings

    get_settings.cache_clear()
    prepare(args)
    rng = random.Random(args.seed)
    ready = workdir / "provider.json"
    provider = Proc("provider", [sys.executable, "-m", "bench.soak", "provider", "--ready", str(ready),
                                 "--seed", str(args.seed)], env, logs)
    deadline = time.monotonic() + 30
    while not ready.exists():
        assert time.monotonic() < deadline, "the fake provider did not start"
        time.sleep(0.1)
    write_pool(workdir, json.loads(ready.read_text()))
    hook_server, hooks, hook_url = serve_hooks(random.Random(args.seed + 1))

    from conductor.store import webhooks as webhook_store
    from conductor.store.db import session_scope
    from conductor.store.keys import create_key

    keys: dict[str, str] = {}
    with session_scope() as s:
        for tenant in TENANTS:
            keys[tenant] = create_key(s, tenant=tenant, pepper=get_settings().api_key_pepper)[1]
        webhook_store.set_default_webhook_url(s, tenant=DEFAULT_HOOK_TENANT, url=f"{hook_url}/default")

    port = free_port()
    api = Proc("api", [sys.executable, "-m", "conductor.cli", "serve", "--host", "127.0.0.1", "--port", str(port),
                       "--log-level", "warning"], env, logs)
    url = f"http://127.0.0.1:{port}"
    import httpx

    deadline = time.monotonic() + 60
    while True:
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{url}/healthz", timeout=1).status_code == 200:
                break
        assert time.monotonic() < deadline, "the API did not become healthy"
        time.sleep(0.2)
    workers = [start_worker(name, pool, c, env, logs, supervise=args.service_chaos) for name, pool, c in WORKERS]
    beat = Proc("beat", [sys.executable, "-m", "conductor.cli", "beat", "--loglevel", "info"], env, logs)
    beat.wait_for_log("beat: Starting")
    log(f"up: api {url}, workers {[w.name for w in workers]}, beat; workdir {workdir}")

    ledger = Ledger(services_restart=services is not None)
    tenants = [Tenant(name, keys[name], url, ledger, hook_url, seed=f"{args.seed}-{name}") for name in TENANTS]
    for t in tenants:
        t.others = [o for o in tenants if o is not t]
    stop_load, stop_chaos = threading.Event(), threading.Event()
    threads = run_load(tenants, stop_load, args.threads, args.pause, args.seed)
    guard = threading.Lock()
    chaos_threads = [threading.Thread(target=chaos, args=(workers, stop_chaos, rng, log,
                                                          (args.kill_min, args.kill_max), guard), daemon=True)]
    outages = Outages()
    stop_watch = threading.Event()
    if services is not None:
        chaos_threads.append(threading.Thread(
            target=service_chaos, args=(services, outages, stop_chaos, random.Random(args.seed + 2), log,
                                        (args.service_min, args.service_max), (args.down_min, args.down_max)),
            daemon=True))
        chaos_threads.append(threading.Thread(target=probe_outages, args=(url, keys["soak-a"], outages, ledger,
                                                                          stop_chaos, log), daemon=True))
        watchdog = threading.Thread(target=watch_processes, args=([*workers, beat, api], guard, ledger, stop_watch,
                                                                  log), daemon=True)
        watchdog.start()
    for thread in chaos_threads:
        thread.start()
    end = time.monotonic() + args.minutes * 60
    while time.monotonic() < end:
        time.sleep(min(30, max(0, end - time.monotonic())))
        with ledger.lock:
            log(f"load: {len(ledger.jobs)} jobs, {len(ledger.batches)} batches, {len(ledger.chats)} chats, "
                f"{len(ledger.responses)} responses, "
                f"{len(ledger.violations)} client-side violations; actions {dict(ledger.actions)}")
    stop_chaos.set()
    for thread in chaos_threads:
        thread.join()
    stop_load.set()
    log("load stopped; waiting for the clients' requests in flight")
    for thread in threads:
        thread.join(timeout=300)

    clients = {t.name: t.http for t in tenants}
    wait_until("jobs not ended", lambda: len(q(
        "SELECT 1 FROM job WHERE status NOT IN ('succeeded','failed','cancelled')")), args.drain * 60, log)

    def batches_open() -> int:
        for batch_id, info in ledger.batches.items():  # a read ends a batch whose jobs all ended
            clients[info["tenant"]].get(f"/v1/batches/{batch_id}")
        return len(q("SELECT 1 FROM batch WHERE status IN ('in_progress', 'cancelling')"))

    wait_until("batches open", batches_open, 60, log)
    wait_until("deliveries pending", lambda: len(q("SELECT 1 FROM webhook_delivery WHERE status = 'pending'")), 90, log)
    wait_until("jobs not folded into the rollup", lambda: len(q(
        "SELECT 1 FROM job WHERE metrics_rolled_up_at IS NULL")), 120, log)
    rolled = q("SELECT count(*) FILTER (WHERE metrics_rolled_up_at IS NOT NULL) AS r, count(*) AS n FROM job")[0]
    log(f"rollup: {rolled.r} of {rolled.n} jobs folded")

    found: list[dict[str, Any]] = list(ledger.violations)

    def v(check: str, **detail: Any) -> None:
        found.append({"check": check, **detail})

    admin = httpx.Client(base_url=url, timeout=60)
    checks: list[tuple[str, Callable[[], None]]] = [
        ("jobs", lambda: check_jobs(v)), ("usage", lambda: check_usage(v)), ("budgets", lambda: check_budgets(v)),
        ("attempts", lambda: check_attempts(v)),
        ("webhooks", lambda: check_webhooks(v, hooks)), ("batches", lambda: check_batches(v, ledger, clients)),
        ("metrics", lambda: check_metrics(v, admin, keys)), ("isolation", lambda: check_isolation(v, ledger, clients)),
        ("chats", lambda: check_chats(v, ledger)),
        ("responses", lambda: check_responses(v, ledger)),
    ]
    for name, check in checks:
        try:
            check()
        except Exception as exc:
            v("check_raised", name=name, error=f"{type(exc).__name__}: {exc}")
    stop_watch.set()
    for proc in [*workers, beat, api]:
        proc.stop()
    provider.stop()
    hook_server.shutdown()
    outage_errors: Counter[str] | None = Counter() if services is not None else None
    check_logs(v, [*workers, beat, api], outage_errors)

    summary = {
        "jobs": dict(Counter(r.status for r in q("SELECT status FROM job"))),
        "child_jobs": q("SELECT count(*) AS n FROM job WHERE parent_job_id IS NOT NULL")[0].n,
        "steps": dict(Counter(r.status for r in q("SELECT status FROM step"))),
        "attempt_outcomes": dict(Counter(r.o for r in q("SELECT COALESCE(error_type, 'ok') AS o FROM step_attempt"))),
        "deliveries": dict(Counter(r.status for r in q("SELECT status FROM webhook_delivery"))),
        "batches": dict(Counter(r.status for r in q("SELECT status FROM batch"))),
        "chats": len(ledger.chats),
        "responses": len(ledger.responses),
        "actions": dict(ledger.actions),
        "kills": sum(w.incarnation for w in workers),
        "violations": dict(Counter(f["check"] for f in found)),
        "warnings": warnings_seen([*workers, beat, api]),
        "checked": dict(CHECKED),
    }
    if services is not None:
        summary["service_faults"] = dict(Counter(o["fault"] for o in outages.done))
        summary["outages"] = outages.done
        summary["probes"] = dict(sorted(outages.probes.items()))
        summary["outage_log_errors"] = dict((outage_errors or Counter()).most_common(40))
        summary["worker_restarts_by_supervisor"] = sum(
            path.read_text(errors="replace").count("the Celery worker exited with code")
            for w in workers for path in w.log_paths)
    (workdir / "report.json").write_text(json.dumps({"summary": summary, "violations": found}, indent=2, default=str))
    log("summary: " + json.dumps(summary, default=str))
    for f in found[:200]:
        log("VIOLATION " + json.dumps(f, default=str)[:3000])
    log(f"{len(found)} violations; report: {workdir / 'report.json'}")
    if services is not None:
        from conductor.store.db import get_engine

        get_engine().dispose()
        services[1].stop(save=False)
        services[0].stop("fast")
    return 1 if found else 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.soak", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command")
    pr = sub.add_parser("provider", help="(internal) the fake providers")
    pr.add_argument("--ready", required=True)
    pr.add_argument("--seed", type=int, default=1)
    p.add_argument("--database-url", help="a database of the soak's own: its tables are TRUNCATED")
    p.add_argument("--broker-url", help="a Redis db of the soak's own (flushed)")
    p.add_argument("--result-backend", help="another Redis db of the soak's own (flushed)")
    p.add_argument("--minutes", type=float, default=12, help="how long the load runs (default 12)")
    p.add_argument("--drain", type=float, default=6, help="minutes to wait for every job to end (default 6)")
    p.add_argument("--threads", type=int, default=2, help="client threads per tenant (default 2)")
    p.add_argument("--pause", type=float, default=1.5, help="mean seconds between a thread's actions (default 1.5)")
    p.add_argument("--kill-min", type=float, default=60, help="seconds between worker kills, at least (default 60)")
    p.add_argument("--kill-max", type=float, default=120, help="and at most (default 120)")
    p.add_argument("--service-chaos", action="store_true",
                   help="run a Postgres cluster and a Redis server of the soak's own (in --workdir, on --pg-port and "
                        "--redis-port) and restart them every --service-min to --service-max seconds")
    p.add_argument("--pg-port", type=int, default=5441, help="the private cluster's port (default 5441)")
    p.add_argument("--redis-port", type=int, default=6395, help="the private Redis server's port (default 6395)")
    p.add_argument("--service-min", type=float, default=120, help="seconds between service faults, at least "
                                                                   "(default 120)")
    p.add_argument("--service-max", type=float, default=240, help="and at most (default 240)")
    p.add_argument("--down-min", type=float, default=SERVICE_DOWN_S[0], help="seconds a restarted service "
                   f"stays down, at least (default {SERVICE_DOWN_S[0]:.0f})")
    p.add_argument("--down-max", type=float, default=SERVICE_DOWN_S[1], help=f"and at most (default "
                                                                            f"{SERVICE_DOWN_S[1]:.0f})")
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--workdir", help="logs and report (default /tmp/conductor-soak-TIMESTAMP)")
    args = p.parse_args(argv)
    if args.command == "provider":
        return provider_main(args)
    if args.service_chaos:
        if args.database_url or args.broker_url or args.result_backend:
            p.error("--service-chaos runs its own Postgres and Redis: leave out --database-url, --broker-url "
                    "and --result-backend")
        return soak_main(args)
    if not (args.database_url and args.broker_url and args.result_backend):
        p.error("--database-url, --broker-url and --result-backend are required (the soak truncates and flushes them)")
    if args.database_url.rstrip("/").endswith("/conductor_test"):
        p.error("conductor_test is the test suite's database: give the soak one of its own")
    return soak_main(args)


if __name__ == "__main__":
    sys.exit(main())
