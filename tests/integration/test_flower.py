"""`conductor flower` against the test broker: behind basic auth, and a job's tasks show up with readable
arguments (job id, step index, agent) while their messages still carry only ids. Steps a worker ran by
continuation (no message of their own) show as part of the task that ran them."""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from conductor.store import jobs as store
from conductor.store.db import session_scope
from tests.integration.harness import Proc, free_port, wait_terminal

AUTH = ("ops", "flower-test-secret")
DIAMOND = {"model_ids": ["a", "b", "c", "d"], "subtasks": ["root", "left", "right", "join"],
           "access_lists": [[], [0], [0], [1, 2]]}


@pytest.fixture(scope="module")
def flower(proc_env: dict[str, str]) -> Iterator[str]:
    port = free_port()
    env = {**proc_env, "FLOWER_BASIC_AUTH": ":".join(AUTH)}
    proc = Proc("flower", [sys.executable, "-m", "conductor.cli", "flower", "--port", str(port)], env)
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

    job_id = client.post("/v1/jobs", json={"task": "flower", "workflow": DIAMOND}).json()["id"]
    assert wait_terminal(client, job_id)["status"] == "succeeded"
    with session_scope() as s:
        task_of = {st.index: st.celery_task_id for st in store.get_steps(s, job_id=job_id)}
    # A worker runs one step its step made ready itself, inside the same task (CONDUCTOR_WORKER_CONTINUE_STEPS);
    # the others are sent. Flower shows one task per message: the plan, and each step that had a message.
    deadline = time.monotonic() + 30
    seen: list[dict[str, Any]] = []
    missing: set[str | None] = {None}
    while missing and time.monotonic() < deadline:  # events reach Flower asynchronously
        seen = tasks_of(flower, job_id)
        done = {t["uuid"] for t in seen if t["state"] == "SUCCESS"}
        missing = set(task_of.values()) - done
        time.sleep(0.3)
    assert not missing, (task_of, seen)
    (plan,) = [t for t in seen if t["name"] == "conductor.plan"]
    assert plan["args"] == f"job={job_id}"
    shown = {t["uuid"]: t["args"] for t in seen if t["name"] == "conductor.run_step"}
    assert shown, "steps 1 and 2 run in parallel, so at least one of them must have had its own message"
    agents = dict(enumerate("abcd"))
    for uuid, label in shown.items():
        # The step a message names runs first in its task; the ones continued after it have higher indices.
        index = min(i for i, task in task_of.items() if task == uuid)
        assert label == f"job={job_id} step={index} agent={agents[index]}"
    assert set(task_of.values()) <= set(shown) | {plan["uuid"]}  # no step ran outside a task Flower shows
