"""A worker runs one step its step made ready itself, in the same task slot (no broker round trip), only
when it consumes that step's queue; switched off, every ready step goes through the broker.

The steps record the Celery task that ran them (``celery_task_id``) and the worker (attempt rows), which
is how these tests see where each step ran. The jobs are planned in this process (as the planner worker
would) so that their steps reach the per-agent queue of a worker started here with its own settings.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import pytest

from conductor.engine import plan_job
from conductor.settings import get_settings
from conductor.store import jobs as store
from conductor.store.db import session_scope
from conductor.store.models import JobStatus
from conductor.submission import JobCreate, create_job
from conductor.tasks.send import send
from tests.integration.harness import agent_queue, start_worker

QUEUE = "steps-continue-c"


@pytest.fixture
def step_queues(monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, str]]:
    with agent_queue(monkeypatch, "c", QUEUE) as mapping:
        yield mapping


def _run(agents: list[str], access_lists: list[list[int]] | None = None) -> tuple[str, list[Any], list[Any]]:
    """A chain over ``agents`` (or the DAG of ``access_lists``), planned here; waits until it ends.
    Returns its id, steps and attempts."""
    settings = get_settings()
    body = {"task": "continuation", "workflow": {
        "model_ids": agents, "subtasks": [f"part {i}" for i in range(len(agents))],
        "access_lists": access_lists or [[i - 1] if i else [] for i in range(len(agents))]}}
    with session_scope() as s:
        job, _ = create_job(s, JobCreate.model_validate(body), tenant="continuation", settings=settings)
    send(plan_job(job.id, settings=settings))
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        with session_scope() as s:
            row = store.get_job(s, job_id=job.id)
            if row is not None and row.status in JobStatus.TERMINAL:
                break
        time.sleep(0.05)
    with session_scope() as s:
        row = store.get_job(s, job_id=job.id)
        steps = store.get_steps(s, job_id=job.id)
        attempts = store.get_attempts(s, step_ids=[st.id for st in steps if st.id is not None])
    assert row is not None and row.status == JobStatus.SUCCEEDED, (row and row.status, row and row.error_message)
    return job.id, steps, attempts


def _attempt(attempts: list[Any], step_id: int | None) -> Any:
    (attempt,) = [a for a in attempts if a.step_id == step_id]
    return attempt


def _worker_of(attempts: list[Any], step_id: int | None) -> str:
    return str(_attempt(attempts, step_id).worker).split("@")[0]


def test_a_chain_runs_in_one_slot_and_a_step_of_another_queue_is_sent(
    step_queues: dict[str, str], proc_env: dict[str, str], workers: object
) -> None:
    own = start_worker({**proc_env, "CONDUCTOR_STEP_QUEUES": json.dumps(step_queues)}, "cont", queues=QUEUE,
                       concurrency=2)
    try:
        _, steps, attempts = _run(["c", "c", "c"])
        assert len({st.celery_task_id for st in steps}) == 1  # the first step's message ran all three
        assert {_worker_of(attempts, st.id) for st in steps} == {"cont"}

        # Step 1's agent `a` is on the shared `steps` queue, which this worker does not consume: it is
        # sent, and a shared worker runs it.
        _, steps, attempts = _run(["c", "a"])
        assert [_worker_of(attempts, st.id) for st in steps] == ["cont", "w1"], own.tail()
        assert len({st.celery_task_id for st in steps}) == 2
    finally:
        own.stop()


def test_switched_off_every_step_goes_through_the_broker(
    step_queues: dict[str, str], proc_env: dict[str, str], workers: object
) -> None:
    env = {**proc_env, "CONDUCTOR_STEP_QUEUES": json.dumps(step_queues), "CONDUCTOR_WORKER_CONTINUE_STEPS": "false"}
    own = start_worker(env, "nocont", queues=QUEUE, concurrency=2)
    try:
        _, steps, attempts = _run(["c", "c", "c"])
        assert len({st.celery_task_id for st in steps}) == 3
        assert {_worker_of(attempts, st.id) for st in steps} == {"nocont"}
    finally:
        own.stop()


FAN_OUT = [[], [0], [0], [0], [1, 2, 3]]  # step 0's outcome makes three steps ready at once


def test_steps_made_ready_together_run_beside_the_task_on_local_slots(
    step_queues: dict[str, str], proc_env: dict[str, str], workers: object
) -> None:
    env = {**proc_env, "CONDUCTOR_STEP_QUEUES": json.dumps(step_queues)}
    own = start_worker(env, "beside", queues=QUEUE, concurrency=2)
    try:
        _, steps, attempts = _run(["c"] * 5, FAN_OUT)
        assert len({st.celery_task_id for st in steps}) == 1, own.tail()  # one message ran all five
        beside = [st.index for st in steps if "/alongside#" in _attempt(attempts, st.id).worker]
        assert beside == [2, 3], [a.worker for a in attempts]  # step 1 continues the task; 2 and 3 beside it
        assert {_worker_of(attempts, st.id) for st in steps} == {"beside"}
        assert "beside it (claimed with the transaction that made it ready; no message)" in own.tail()
    finally:
        own.stop()


def test_a_gevent_worker_runs_them_beside_the_task_on_greenlets(
    step_queues: dict[str, str], proc_env: dict[str, str], workers: object
) -> None:
    # The local slots' threads are greenlets there (the standard library is patched before anything
    # starts, queue.SimpleQueue included): a slot waiting for work must not block the worker's hub.
    env = {**proc_env, "CONDUCTOR_STEP_QUEUES": json.dumps(step_queues)}
    own = start_worker(env, "green", queues=QUEUE, concurrency=20, pool="gevent")
    try:
        for _ in range(2):  # the second finds the slots' greenlets waiting for work
            _, steps, attempts = _run(["c"] * 5, FAN_OUT)
            assert len({st.celery_task_id for st in steps}) == 1, own.tail()
            assert [st.index for st in steps if "/alongside#" in _attempt(attempts, st.id).worker] == [2, 3]
    finally:
        own.stop()


def test_with_no_local_slots_parallel_steps_go_through_the_broker(
    step_queues: dict[str, str], proc_env: dict[str, str], workers: object
) -> None:
    env = {**proc_env, "CONDUCTOR_STEP_QUEUES": json.dumps(step_queues), "CONDUCTOR_WORKER_LOCAL_SLOTS": "0"}
    own = start_worker(env, "noslots", queues=QUEUE, concurrency=2)
    try:
        _, steps, attempts = _run(["c"] * 5, FAN_OUT)
        assert len({st.celery_task_id for st in steps}) == 3  # steps 2 and 3 were sent
        assert not any("alongside" in a.worker for a in attempts), [a.worker for a in attempts]
    finally:
        own.stop()
