"""`conductor flower` against the test broker: behind basic auth, and a job's tasks show up with readable
arguments (job id, step index, agent) while their messages still carry only ids. Steps a worker ran by
continuation or beside a task (no message of their own) show as part of the task that ran them."""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from conductor.engine import plan_job
from conductor.settings import get_settings
from conductor.store import jobs as store
from conductor.store.db import session_scope
from conductor.store.models import JobStatus
from conductor.submission import JobCreate, create_job
from conductor.tasks.send import send
from tests.integration.harness import Proc, free_port, wait_terminal

AUTH = ("ops", "flower-test-secret")
DIAMOND = {"model_ids": ["a", "b", "c", "d"], "subtasks": ["root", "left", "right", "join"],
           "access_lists": [[], [0], [0], [1, 2]]}


@pytest.fixture(scope="module")
def flower(proc_env: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    # The login is in a .env file, as an operator may keep it: Flower itself reads only the environment,
    # so `conductor flower` hands it over (it once checked the .env value, then served with no login).
    port = free_port()
    where = tmp_path_factory.mktemp("flower")
    (where / ".env").write_text(f"FLOWER_BASIC_AUTH={':'.join(AUTH)}\n")
    env = {k: v for k, v in proc_env.items() if k != "FLOWER_BASIC_AUTH"}
    proc = Proc("flower", [sys.executable, "-m", "conductor.cli", "flower", "--port", str(port)], env, cwd=where)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/api/workers", auth=AUTH, timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        if proc.popen.poll() is not None:
            raise RuntimeError(f"flower exited early:\n{proc.tail()}")
        time.sleep(0.2)
    else:
        raise RuntimeError(f"flower did not answer:\n{proc.tail()}")
    yield url
    proc.stop()


def tasks_of(flower: str, job_id: str) -> list[dict[str, Any]]:
    tasks = httpx.get(f"{flower}/api/tasks", auth=AUTH, timeout=10).json()
    return [t for t in tasks.values() if f"job={job_id}" in (t.get("args") or "")]


def test_flower_shows_readable_step_tasks_behind_basic_auth(flower: str, client: httpx.Client) -> None:
    assert httpx.get(f"{flower}/api/tasks", timeout=10).status_code == 401
    assert httpx.get(f"{flower}/api/tasks", auth=("ops", "wrong"), timeout=10).status_code == 401

    # A worker runs the steps a step made ready itself: one in the same task (CONDUCTOR_WORKER_CONTINUE_STEPS)
    # and the parallel ones beside it (CONDUCTOR_WORKER_LOCAL_SLOTS), so the planner's task ran the diamond.
    job_id = client.post("/v1/jobs", json={"task": "flower", "workflow": DIAMOND}).json()["id"]
    assert wait_terminal(client, job_id)["status"] == "succeeded"
    seen = _tasks_done(flower, job_id)
    (plan,) = [t for t in seen if t["name"] == "conductor.plan"]
    assert plan["args"] == f"job={job_id}"
    assert set(_task_of(job_id).values()) == {plan["uuid"]}  # no step ran outside the task Flower shows

    # Steps sent as messages (planned here, by a planner that runs none of them itself) are tasks of their
    # own, labelled with their step and agent.
    with session_scope() as s:
        job, _ = create_job(s, JobCreate.model_validate({"task": "flower", "workflow": DIAMOND}), tenant="flower",
                            settings=get_settings())
    job_id = job.id
    send(plan_job(job_id, settings=get_settings()))
    deadline = time.monotonic() + 60
    while (ended := _status(job_id)) not in JobStatus.TERMINAL and time.monotonic() < deadline:
        time.sleep(0.1)
    assert ended == JobStatus.SUCCEEDED
    seen = _tasks_done(flower, job_id)
    shown = {t["uuid"]: t["args"] for t in seen if t["name"] == "conductor.run_step"}
    task_of = _task_of(job_id)
    agents = dict(enumerate("abcd"))
    assert shown and set(task_of.values()) <= set(shown)
    for uuid, label in shown.items():
        # The step a message names runs first in its task; the ones continued after it have higher indices.
        index = min(i for i, task in task_of.items() if task == uuid)
        assert label == f"job={job_id} step={index} agent={agents[index]}"


def _status(job_id: str) -> str | None:
    with session_scope() as s:
        job = store.get_job(s, job_id=job_id)
        return job.status if job is not None else None


def _task_of(job_id: str) -> dict[int, str | None]:
    with session_scope() as s:
        return {st.index: st.celery_task_id for st in store.get_steps(s, job_id=job_id)}


def _tasks_done(flower: str, job_id: str) -> list[dict[str, Any]]:
    """The job's tasks in Flower once every task that ran one of its steps shows as succeeded (events
    reach Flower asynchronously)."""
    task_of = _task_of(job_id)
    deadline = time.monotonic() + 30
    seen: list[dict[str, Any]] = []
    missing: set[str | None] = {None}
    while missing and time.monotonic() < deadline:
        seen = tasks_of(flower, job_id)
        done = {t["uuid"] for t in seen if t["state"] == "SUCCESS"}
        missing = set(task_of.values()) - done
        time.sleep(0.3)
    assert not missing, (task_of, seen)
    return seen
