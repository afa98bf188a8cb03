"""A batch's lines wait behind live submissions on the broker: their plan and step messages go at the lowest
Redis priority, so a planner worker takes a live job submitted after a batch before the batch's lines, and a
step worker a live job's steps before theirs. Runs its own API and workers on a broker database of its own
(the shared workers would take the messages first)."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
import redis
import sqlalchemy as sa

from conductor.store.db import session_scope
from conductor.tasks.send import BATCH_PRIORITY
from tests.integration.conftest import new_key
from tests.integration.harness import Proc, start_api, start_worker, wait_terminal

BROKER = os.environ.get("CONDUCTOR_TEST_PRIORITY_BROKER", "redis://127.0.0.1:6379/2")
ONE_STEP = {"model_ids": ["a"], "subtasks": ["x"], "access_lists": [[]]}


@pytest.fixture
def env(proc_env: dict[str, str]) -> Iterator[dict[str, str]]:
    broker = redis.Redis.from_url(BROKER)
    broker.flushdb()
    yield {**proc_env, "CONDUCTOR_BROKER_URL": BROKER, "CONDUCTOR_RESULT_BACKEND": BROKER}
    broker.flushdb()


def _enqueued(job_ids: list[str]) -> bool:
    with session_scope() as s:
        rows = s.execute(sa.text("SELECT count(*) FROM job WHERE id = ANY(:ids) AND enqueued_at IS NOT NULL"),
                         {"ids": job_ids}).scalar_one()
    return int(rows) == len(job_ids)


def test_a_live_job_submitted_after_a_batch_is_planned_before_the_batchs_lines(env: dict[str, str]) -> None:
    api, url = start_api(env)
    worker: Proc | None = None
    key = new_key("tenant-priority")
    try:
        with openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0) as client, \
                httpx.Client(base_url=url, headers={"Authorization": f"Bearer {key}"}, timeout=30) as http:
            lines = "".join(json.dumps({"custom_id": f"b{n}", "method": "POST", "url": "/v1/jobs",
                                        "body": {"task": f"line {n}", "workflow": ONE_STEP}}) + "\n"
                            for n in range(3))
            uploaded = client.files.create(file=("p.jsonl", lines.encode()), purpose="batch")
            batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/jobs", completion_window="24h")
            with session_scope() as s:
                line_jobs = [r[0] for r in s.execute(sa.text(
                    "SELECT job_id FROM batch_request WHERE batch_id = :b ORDER BY line"), {"b": batch.id})]
            deadline = time.monotonic() + 30  # the batch's plans are sent after its answer
            while not _enqueued(line_jobs) and time.monotonic() < deadline:
                time.sleep(0.05)
            assert _enqueued(line_jobs)
            live = http.post("/v1/jobs", json={"task": "live", "workflow": ONE_STEP})
            assert live.status_code == 202, live.text
            live_id = live.json()["id"]

            queued = redis.Redis.from_url(BROKER)
            assert queued.llen("planner") == 1  # the live plan, at the default priority
            assert queued.llen(f"planner\x06\x16{BATCH_PRIORITY}") == 3  # the lines', polled last

            worker = start_worker(env, "prio", queues="planner,steps", concurrency=1)
            assert wait_terminal(http, live_id)["status"] == "succeeded"
            ended = client.batches.retrieve(batch.id)
            deadline = time.monotonic() + 60
            while ended.status != "completed" and time.monotonic() < deadline:
                time.sleep(0.2)
                ended = client.batches.retrieve(batch.id)
            assert ended.status == "completed", ended
        with session_scope() as s:
            started: dict[str, Any] = dict(s.execute(sa.text(  # planning's start, from the server's clock
                "SELECT id, started_at FROM job WHERE id = ANY(:ids)"), {"ids": [*line_jobs, live_id]}).all())
        assert started[live_id] < min(started[j] for j in line_jobs), started
    finally:
        if worker is not None:
            worker.stop()
        api.stop()


CHAIN = {"model_ids": ["a", "a"], "subtasks": ["x", "y"], "access_lists": [[], [0]]}


def _running(job_ids: list[str]) -> bool:
    with session_scope() as s:
        rows = s.execute(sa.text("SELECT count(*) FROM job WHERE id = ANY(:ids) AND status = 'running'"),
                         {"ids": job_ids}).scalar_one()
    return int(rows) == len(job_ids)


def test_a_batchs_steps_wait_behind_a_live_jobs_steps(env: dict[str, str]) -> None:
    """Once planned, a line's steps go at the batch priority too: a live job planned after a batch's lines has
    its root step in the steps queue's priority-0 list and the lines' roots wait in its priority-9 list, so a
    steps worker started then runs the live job first. A line's second step, made ready by its first's outcome,
    is sent at that priority again rather than continued in the worker's slot: the lines' steps interleave
    (each hop goes back behind the broker's other messages), where a continued chain ran each line to its end.
    Orders come from the attempts' ids (one worker, one slot: they are inserted in the order steps start)."""
    api, url = start_api(env)
    workers: list[Proc] = []
    key = new_key("tenant-priority-steps")
    try:
        with openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0) as client, \
                httpx.Client(base_url=url, headers={"Authorization": f"Bearer {key}"}, timeout=30) as http:
            lines = "".join(json.dumps({"custom_id": f"b{n}", "method": "POST", "url": "/v1/jobs",
                                        "body": {"task": f"line {n}", "workflow": CHAIN}}) + "\n"
                            for n in range(2))
            uploaded = client.files.create(file=("s.jsonl", lines.encode()), purpose="batch")
            batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/jobs", completion_window="24h")
            with session_scope() as s:
                line_jobs = [r[0] for r in s.execute(sa.text(
                    "SELECT job_id FROM batch_request WHERE batch_id = :b ORDER BY line"), {"b": batch.id})]
            workers.append(start_worker(env, "prio-planner", queues="planner", concurrency=1))
            deadline = time.monotonic() + 60
            while not _running(line_jobs) and time.monotonic() < deadline:
                time.sleep(0.05)
            assert _running(line_jobs)
            live = http.post("/v1/jobs", json={"task": "live", "workflow": CHAIN})
            assert live.status_code == 202, live.text
            live_id = live.json()["id"]
            deadline = time.monotonic() + 60
            while not _running([live_id]) and time.monotonic() < deadline:
                time.sleep(0.05)
            assert _running([live_id])

            queued = redis.Redis.from_url(BROKER)
            assert queued.llen("steps") == 1  # the live job's root, at the default priority
            assert queued.llen(f"steps\x06\x16{BATCH_PRIORITY}") == 2  # the lines' roots, polled last

            workers.append(start_worker(env, "prio-steps", queues="steps", concurrency=1))
            assert wait_terminal(http, live_id)["status"] == "succeeded"
            for job_id in line_jobs:
                assert wait_terminal(http, job_id)["status"] == "succeeded"
        with session_scope() as s:
            started = [(r[0], r[1]) for r in s.execute(sa.text(
                "SELECT st.job_id, st.index FROM step_attempt a JOIN step st ON st.id = a.step_id "
                "WHERE st.job_id = ANY(:ids) ORDER BY a.id"), {"ids": [*line_jobs, live_id]})]
        first, second = line_jobs
        assert started == [(live_id, 0), (live_id, 1), (first, 0), (second, 0), (first, 1), (second, 1)], started
    finally:
        for worker in workers:
            worker.stop()
        api.stop()


RECURSIVE = {"model_ids": ["conductor"], "subtasks": ["split it up"], "access_lists": [[]]}


def _child_of(root_id: str) -> str | None:
    """The line's child job once its plan was sent (``enqueued_at`` is written after the send)."""
    with session_scope() as s:
        row = s.execute(sa.text("SELECT id FROM job WHERE root_job_id = :r AND enqueued_at IS NOT NULL"),
                        {"r": root_id}).first()
    return None if row is None else str(row[0])


def test_a_lines_child_job_is_batch_work_too(env: dict[str, str]) -> None:
    """A line's recursive step starts a child job: only the line carries ``batch_id``, but the child's work is
    the line's. Its plan message goes at the batch priority (the steps worker that started it sends it), and
    so do its steps once planned. Each stage runs with one queue's worker only, so the messages stay in the
    broker's lists to be counted."""
    api, url = start_api(env)
    worker: Proc | None = None
    key = new_key("tenant-priority-child")
    queued = redis.Redis.from_url(BROKER)
    low = f"\x06\x16{BATCH_PRIORITY}"

    def only(queues: str, until: Any) -> None:
        nonlocal worker
        worker = start_worker(env, f"prio-{queues}", queues=queues, concurrency=1)
        deadline = time.monotonic() + 60
        while not until() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert until(), worker.tail()
        worker.stop()
        worker = None

    try:
        with openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0) as client, \
                httpx.Client(base_url=url, headers={"Authorization": f"Bearer {key}"}, timeout=30) as http:
            line = json.dumps({"custom_id": "r", "method": "POST", "url": "/v1/jobs",
                               "body": {"task": "recurse", "workflow": RECURSIVE}}) + "\n"
            uploaded = client.files.create(file=("r.jsonl", line.encode()), purpose="batch")
            batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/jobs", completion_window="24h")
            with session_scope() as s:
                (line_job,) = [r[0] for r in s.execute(sa.text(
                    "SELECT job_id FROM batch_request WHERE batch_id = :b"), {"b": batch.id})]
            only("planner", lambda: _running([line_job]))  # the line's plan: its recursive step is sent
            assert (queued.llen("steps"), queued.llen(f"steps{low}")) == (0, 1)
            only("steps", lambda: _child_of(line_job) is not None)  # the step starts the child, sends its plan
            child = _child_of(line_job)
            assert child is not None
            assert (queued.llen("planner"), queued.llen(f"planner{low}")) == (0, 1)
            only("planner", lambda: _running([child]))  # the child's plan: its root step is sent
            assert (queued.llen("steps"), queued.llen(f"steps{low}")) == (0, 1)
            worker = start_worker(env, "prio-all", queues="planner,steps", concurrency=1)
            assert wait_terminal(http, line_job)["status"] == "succeeded"
        with session_scope() as s:
            line_batch, child_batch = s.execute(sa.text(
                "SELECT (SELECT batch_id FROM job WHERE id = :l), (SELECT batch_id FROM job WHERE id = :c)"),
                {"l": line_job, "c": child}).one()
        assert (line_batch, child_batch) == (batch.id, None)  # the child is not a line of the batch
    finally:
        if worker is not None:
            worker.stop()
        api.stop()


def test_a_lines_planner_calls_wait_as_batch_work(monkeypatch: pytest.MonkeyPatch) -> None:
    """A line planned by a model (here a sim agent, whose answer is no workflow: one re-ask, then the template)
    asks the rate limiter as batch work at every planner call, and so does a child job in the line's tree
    (which carries no ``batch_id``: the planning's claim reads its root's in the same statement); a live job
    asks as live work."""
    from conductor.engine import plan_job
    from conductor.planning import planner
    from conductor.settings import get_settings
    from conductor.store.models import Job
    from conductor.submission import JobCreate, create_job

    asked: list[tuple[str, bool]] = []
    real = planner.wait_for_rate_limit

    def spy(agent: str, rpm: int | None, settings: Any, *, tenant: str, **kwargs: Any) -> None:
        asked.append((tenant, bool(kwargs.get("background"))))
        real(agent, rpm, settings, tenant=tenant, **kwargs)

    def planned(job_id: str) -> list[tuple[str, bool]]:
        asked.clear()
        plan_job(job_id, settings=get_settings())
        return list(asked)

    monkeypatch.setattr(planner, "wait_for_rate_limit", spy)
    jobs: dict[str, str] = {}
    for name, batch_id in (("line", "batch_planner_calls"), ("live", None)):
        with session_scope() as s:
            job, _ = create_job(s, JobCreate.model_validate({"task": "plan me", "planner": "a"}), tenant="planning",
                                settings=get_settings(), batch_id=batch_id)
            jobs[name] = job.id
    calls = {name: planned(job_id) for name, job_id in jobs.items()}
    for name in ("line", "live"):  # a child job, as a recursive step of the line (or the live job) starts it
        with session_scope() as s:
            parent = s.get(Job, jobs[name])
            assert parent is not None
            child = Job(tenant=parent.tenant, task="sub", pool=parent.pool, pool_config=parent.pool_config,
                        planner="a", depth=1, parent_job_id=parent.id, parent_step_index=0, root_job_id=parent.id,
                        context=[], limits={}, meta={})
            s.add(child)
            s.flush()
            child_id = child.id
        calls[f"{name}'s child"] = planned(child_id)
    assert all(calls.values()), calls
    assert {name: {bg for _, bg in asks} for name, asks in calls.items()} == {
        "line": {True}, "line's child": {True}, "live": {False}, "live's child": {False}}, calls
