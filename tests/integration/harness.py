"""Real processes for integration tests: Celery workers and the API (uvicorn) on loopback."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest

ROOT = Path(__file__).resolve().parents[2]
LOGS = Path(os.environ.get("CONDUCTOR_TEST_LOGS", "/tmp/conductor-test-logs"))
TERMINAL = ("succeeded", "failed", "cancelled")


@contextmanager
def sent_statements() -> Iterator[list[str]]:
    """Every SQL statement this process sends to the test database while the block runs."""
    import sqlalchemy as sa

    from conductor.store.db import get_engine

    statements: list[str] = []

    def seen(_conn: Any, _cursor: Any, statement: str, *_: Any) -> None:
        statements.append(statement)

    engine = get_engine()
    sa.event.listen(engine, "before_cursor_execute", seen)
    try:
        yield statements
    finally:
        sa.event.remove(engine, "before_cursor_execute", seen)


@contextmanager
def scratch_database(suffix: str) -> Iterator[str]:
    """An empty database beside the test database (its name + ``_suffix``, so runs against other test
    databases never meet), dropped afterwards even if connections remain; yields its URL."""
    import sqlalchemy as sa

    from conductor.settings import get_settings

    base = sa.make_url(get_settings().database_url)
    name = f"{base.database}_{suffix}"
    admin = sa.create_engine(base.set(database="postgres"), isolation_level="AUTOCOMMIT", poolclass=sa.NullPool)
    try:
        with admin.connect() as conn:
            conn.exec_driver_sql(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
            conn.exec_driver_sql(f'CREATE DATABASE "{name}"')
        try:
            yield base.set(database=name).render_as_string(hide_password=False)
        finally:
            with admin.connect() as conn:
                conn.exec_driver_sql(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    finally:
        admin.dispose()


@contextmanager
def agent_queue(monkeypatch: pytest.MonkeyPatch, agent: str, queue: str) -> Iterator[dict[str, str]]:
    """This process routes ``agent``'s steps to ``queue`` (``CONDUCTOR_STEP_QUEUES``) until the block ends;
    then the setting is restored and the queue's leftover messages are dropped. Yields the mapping, for
    the environment of a worker started on that queue."""
    import redis

    from conductor.settings import get_settings

    mapping = {agent: queue}
    monkeypatch.setenv("CONDUCTOR_STEP_QUEUES", json.dumps(mapping))
    get_settings.cache_clear()
    try:
        yield mapping
    finally:
        monkeypatch.delenv("CONDUCTOR_STEP_QUEUES")
        get_settings.cache_clear()
        redis.Redis.from_url(get_settings().broker_url).delete(queue)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Proc:
    """A child process whose output goes to a log file, shown when a test fails."""

    def __init__(self, name: str, argv: list[str], env: dict[str, str], cwd: Path = ROOT):
        """``cwd`` is also where ``python -m`` imports ``conductor`` from (it comes first on sys.path)."""
        LOGS.mkdir(parents=True, exist_ok=True)
        self.name = name
        self.log_path = LOGS / f"{name}-{os.getpid()}-{time.monotonic_ns()}.log"
        self.log = self.log_path.open("wb")
        self.popen = subprocess.Popen(
            argv, env=env, cwd=cwd, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True
        )

    def tail(self, n: int = 60) -> str:
        self.log.flush()
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])

    def wait_for_log(self, needle: str, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if needle in self.log_path.read_text(errors="replace"):
                return
            if self.popen.poll() is not None:
                raise RuntimeError(f"{self.name} exited early:\n{self.tail()}")
            time.sleep(0.1)
        raise RuntimeError(f"{self.name} did not log {needle!r} within {timeout}s:\n{self.tail()}")

    def kill(self, sig: int = signal.SIGKILL) -> None:
        if self.popen.poll() is None:
            os.killpg(self.popen.pid, sig)
        self.popen.wait(timeout=30)

    def stop(self) -> None:
        if self.popen.poll() is None:
            os.killpg(self.popen.pid, signal.SIGTERM)
            try:
                self.popen.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.kill()
        self.log.close()


ALL_QUEUES = "planner,steps,maintenance"


def start_worker(env: dict[str, str], name: str, queues: str = ALL_QUEUES, concurrency: int = 8,
                 pool: str | None = None) -> Proc:
    argv = [sys.executable, "-m", "conductor.cli", "worker", "--queues", queues, "--concurrency", str(concurrency),
            "--hostname", f"{name}@%h", "--loglevel", "info", *(["--pool", pool] if pool else [])]
    proc = Proc(name, argv, env)
    proc.wait_for_log("ready.")
    return proc


def start_api(env: dict[str, str], workers: int = 1, cwd: Path = ROOT) -> tuple[Proc, str]:
    port = free_port()
    argv = [sys.executable, "-m", "conductor.cli", "serve", "--host", "127.0.0.1", "--port", str(port),
            "--log-level", "warning", "--workers", str(workers)]  # as deployed (conductor/service/server.py)
    if not (cwd / "conductor" / "service" / "server.py").exists():  # an older checkout (bench --code)
        argv = [sys.executable, "-m", "uvicorn", "conductor.service.app:create_app", "--factory",
                "--host", "127.0.0.1", "--port", str(port), "--log-level", "warning", "--workers", str(workers)]
    proc = Proc("api", argv, env, cwd)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/healthz", timeout=1).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        if proc.popen.poll() is not None:
            raise RuntimeError(f"api exited early:\n{proc.tail()}")
        time.sleep(0.1)
    raise RuntimeError(f"api did not become healthy:\n{proc.tail()}")


def wait_terminal(client: httpx.Client, job_id: str, timeout: float = 90) -> dict[str, Any]:
    """Polls until the job ends. The timeout only keeps a broken run from hanging; it asserts nothing."""
    deadline = time.monotonic() + timeout
    job: dict[str, Any] = {}
    while time.monotonic() < deadline:
        job = client.get(f"/v1/jobs/{job_id}").json()
        if job.get("status") in TERMINAL:
            return job
        time.sleep(0.1)
    raise AssertionError(f"job {job_id} did not finish; last seen: {job}")


def backend_pid(session: Any) -> int:
    """The Postgres backend a session's transaction runs on."""
    import sqlalchemy as sa

    return int(session.execute(sa.text("SELECT pg_backend_pid()")).scalar_one())


def wait_blocked_by(pid: int, timeout: float = 30) -> None:
    """Until another backend waits on a lock that backend ``pid`` holds: a race staged by a test is then
    really a race (a fixed sleep could let the test pass with the other side not yet at the lock)."""
    import sqlalchemy as sa

    from conductor.store.db import get_engine

    deadline = time.monotonic() + timeout
    with get_engine().connect() as conn:
        while True:
            waiting = conn.execute(sa.text("SELECT count(*) FROM pg_stat_activity "
                                           "WHERE :pid = ANY(pg_blocking_pids(pid))"), {"pid": pid}).scalar_one()
            conn.rollback()
            if waiting:
                return
            assert time.monotonic() < deadline, f"nothing waited on backend {pid}'s locks"
            time.sleep(0.02)
