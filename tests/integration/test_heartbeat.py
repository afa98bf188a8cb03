"""Liveness: a live worker's short lease is kept alive by its heartbeat through a call longer than the
lease, and a SIGKILLed worker's step is re-run (it stopped renewing) with exactly one final output.

Own broker database, API, reconciler (``conductor beat``) and workers, so no other worker can take the
step; the lease is 3 s and the call 8 s, so without the heartbeat the first call would be taken over.
The re-run delay is printed (a figure for docs/benchmarks.md), never asserted.
"""

from __future__ import annotations

import os
import re
import signal
import sys
import time
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis
import sqlalchemy as sa
import yaml

from conductor.settings import get_settings
from conductor.store.db import get_engine
from tests.integration.conftest import new_key
from tests.integration.harness import Proc, start_api, start_worker, wait_terminal

BROKER = os.environ.get("CONDUCTOR_TEST_HEARTBEAT_BROKER", "redis://127.0.0.1:6379/4")
LEASE_S = 3
CALL_MS = 8000


@pytest.fixture(scope="module")
def hb_env(proc_env: dict[str, str], pools_dir: Path) -> dict[str, str]:
    pool = {"planner": "template:single", "agents": {"long": {"provider": "sim", "options": {"latency_ms": CALL_MS}},
                                                      "mid": {"provider": "sim", "options": {"latency_ms": 3000}},
                                                      "quick": {"provider": "sim"}}}
    (pools_dir / "heartbeat.yaml").write_text(yaml.safe_dump(pool))
    redis.Redis.from_url(BROKER).flushdb()
    return {
        **proc_env,
        "CONDUCTOR_BROKER_URL": BROKER,
        "CONDUCTOR_RESULT_BACKEND": BROKER,
        "CONDUCTOR_STEP_LEASE_S": str(LEASE_S),
        "CONDUCTOR_RECONCILE_INTERVAL_S": "1",
        "CONDUCTOR_RECONCILE_STALE_S": "3",
        "CONDUCTOR_PLANNING_STALE_S": "3",
    }


@pytest.fixture(scope="module")
def hb_beat(hb_env: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Proc]:
    env = {**hb_env, "CONDUCTOR_DATA_DIR": str(tmp_path_factory.mktemp("hb-beat"))}
    proc = Proc("hb-beat", [sys.executable, "-m", "conductor.cli", "beat", "--loglevel", "info"], env)
    proc.wait_for_log("beat: Starting")
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def hb_api(hb_env: dict[str, str]) -> Iterator[httpx.Client]:
    proc, url = start_api(hb_env)
    with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {new_key('heartbeat')}"}, timeout=30) as c:
        yield c
    proc.stop()


def step_and_attempts(job_id: str, index: int = 0) -> tuple[Any, list[Any]]:
    with get_engine(get_settings().database_url).connect() as conn:
        step = conn.execute(sa.text("SELECT id, status, output, attempts, lease_expires_at FROM step "
                                    "WHERE job_id = :id AND index = :i"), {"id": job_id, "i": index}).first()
        if step is None:
            return None, []
        attempts = list(conn.execute(sa.text("SELECT n, worker, started_at, finished_at, error_type, latency_ms "
                                             "FROM step_attempt WHERE step_id = :s ORDER BY n"), {"s": step.id}))
    return step, attempts


def submit(client: httpx.Client, task: str, agents: list[str], access_lists: list[list[int]]) -> str:
    workflow = {"model_ids": agents, "subtasks": [f"{task} {i}" for i in range(len(agents))],
                "access_lists": access_lists}
    r = client.post("/v1/jobs", json={"task": task, "pool": "heartbeat", "workflow": workflow})
    assert r.status_code == 202, r.text
    return str(r.json()["id"])


def wait_renewed(job_id: str, indices: list[int]) -> list[tuple[Any, list[Any]]]:
    """Waits until a live worker's heartbeat has pushed each step's lease past the one its claim set."""
    deadline = time.monotonic() + 60
    while True:
        steps = [step_and_attempts(job_id, i) for i in indices]
        if all(attempts and step.lease_expires_at > attempts[0].started_at + timedelta(seconds=LEASE_S + 0.5)
               for step, attempts in steps):
            return steps
        assert time.monotonic() < deadline, f"the leases were never renewed: {steps}"
        time.sleep(0.1)


def finish_on_a_survivor(env: dict[str, str], client: httpx.Client, name: str, job_id: str) -> dict[str, Any]:
    survivor = start_worker(env, name, concurrency=4)
    try:
        return wait_terminal(client, job_id, timeout=120)
    finally:
        survivor.stop()


def test_a_sigkilled_workers_step_reruns_once_its_lease_lapses(hb_env: dict[str, str], hb_api: httpx.Client,
                                                               hb_beat: Proc) -> None:
    doomed = start_worker(hb_env, "hb-doomed", concurrency=2)
    job_id = submit(hb_api, "heartbeat", ["long"], [[]])
    ((step, attempts),) = wait_renewed(job_id, [0])
    assert step.status == "running" and len(attempts) == 1 and attempts[0].finished_at is None
    doomed.kill(signal.SIGKILL)
    killed_at = time.time()
    doomed.stop()

    job = finish_on_a_survivor(hb_env, hb_api, "hb-survivor", job_id)

    assert job["status"] == "succeeded", job
    assert job["answer"] == "[long] heartbeat 0"
    step, attempts = step_and_attempts(job_id)
    assert step.status == "succeeded" and step.attempts == 2 and step.output == "[long] heartbeat 0"
    assert [a.error_type for a in attempts] == ["worker_lost", None]  # one final output, from the re-run
    assert all(a.finished_at is not None for a in attempts)
    assert attempts[0].worker.startswith("hb-doomed@") and attempts[1].worker.startswith("hb-survivor@")
    # The re-run call (8 s) outlived its 3 s lease without being taken over: the survivor's heartbeat.
    assert attempts[1].latency_ms >= CALL_MS
    rerun_after = attempts[1].started_at.timestamp() - killed_at
    print(f"\nre-run started {rerun_after:.1f} s after the SIGKILL (lease {LEASE_S} s, reconcile interval 1 s)")


def test_a_sigkilled_workers_steps_run_beside_its_task_rerun_too(hb_env: dict[str, str], hb_api: httpx.Client,
                                                                 hb_beat: Proc) -> None:
    # The planner worker claims the three roots with the plan and runs two of them beside its task, on its
    # local slots: their leases are renewed by the same heartbeat, and lapse with it.
    doomed = start_worker(hb_env, "hb-doomed2", concurrency=2)
    job_id = submit(hb_api, "heartbeat", ["long", "long", "long", "quick"], [[], [], [], [0, 1, 2]])
    roots = wait_renewed(job_id, [0, 1, 2])
    assert sum("/alongside#" in attempts[0].worker for _, attempts in roots) == 2, roots
    doomed.kill(signal.SIGKILL)
    doomed.stop()

    job = finish_on_a_survivor(hb_env, hb_api, "hb-survivor2", job_id)

    assert job["status"] == "succeeded", job
    for i in range(3):
        step, attempts = step_and_attempts(job_id, i)
        assert step.status == "succeeded" and step.attempts == 2 and step.output == f"[long] heartbeat {i}"
        assert [a.error_type for a in attempts] == ["worker_lost", None]  # one final output each
        assert attempts[0].worker.startswith("hb-doomed2@") and attempts[1].worker.startswith("hb-survivor2@")


def test_a_warm_shutdown_waits_for_the_steps_run_beside_its_tasks(hb_env: dict[str, str], hb_api: httpx.Client) -> None:
    # SIGTERM while two 3 s roots run beside the planner's task (its own root is quick): Celery waits for
    # the task, the task for the steps beside it, and the last root's outcome continues with the join.
    worker = start_worker(hb_env, "hb-graceful", concurrency=2)
    job_id = submit(hb_api, "graceful", ["quick", "mid", "mid", "quick"], [[], [], [], [0, 1, 2]])
    deadline = time.monotonic() + 30
    while not all(step_and_attempts(job_id, i)[1] for i in (1, 2)):
        assert time.monotonic() < deadline, worker.tail()
        time.sleep(0.05)

    os.killpg(worker.popen.pid, signal.SIGTERM)
    assert worker.popen.wait(timeout=30) == 0, worker.tail()  # exited by itself once the steps were done
    log = worker.tail(200)
    worker.stop()

    job = hb_api.get(f"/v1/jobs/{job_id}").json()  # no other worker ran anything: the job ended before
    assert job["status"] == "succeeded", job
    for i in range(4):
        step, attempts = step_and_attempts(job_id, i)
        assert step.status == "succeeded" and step.attempts == 1, step
        assert [a.error_type for a in attempts] == [None] and attempts[0].worker.startswith("hb-graceful@")
    # The planner's task lasted as long as the calls beside it (its own step took no time): it is what the
    # warm shutdown waited for, and what Flower showed as active meanwhile.
    (task_id, runtime_s), = re.findall(r"Task conductor\.plan\[([0-9a-f-]+)\] succeeded in ([0-9.]+)s", log)
    beside = [step_and_attempts(job_id, i)[1][0] for i in (1, 2)]
    assert all("/alongside#" in a.worker for a in beside), beside
    assert float(runtime_s) * 1000 >= max(a.latency_ms for a in beside), (runtime_s, beside)
    assert all(f"task {task_id} runs job={job_id} step={i} agent=mid beside it" in log for i in (1, 2)), log
