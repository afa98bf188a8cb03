"""A queue per agent (CONDUCTOR_STEP_QUEUES): its steps, first sends and reconciler re-sends alike, wait
in that queue until a worker that consumes it runs them; workers of the shared `steps` queue never do."""

from __future__ import annotations

import base64
import json
import time
from collections.abc import Iterator
from datetime import timedelta

import pytest
import redis

from conductor.engine import plan_job
from conductor.reconcile import reconcile_once
from conductor.settings import get_settings
from conductor.store import jobs as store
from conductor.store.db import session_scope
from conductor.store.models import JobStatus, StepStatus, utcnow
from conductor.submission import JobCreate, create_job
from conductor.tasks.send import send
from tests.integration.harness import agent_queue, start_worker

QUEUE = "steps-obs-b"


def waiting_for(broker: redis.Redis, job_id: str) -> int:
    """How many of the messages waiting in ``QUEUE`` run a step of ``job_id`` (a Celery message on Redis:
    a JSON envelope whose headers carry the task's arguments, its body them again, base64-encoded)."""
    count = 0
    for raw in broker.lrange(QUEUE, 0, -1):
        envelope = json.loads(raw)
        body = base64.b64decode(envelope.get("body", "")).decode("utf-8", "replace")
        count += job_id in str(envelope.get("headers", {}).get("argsrepr", "")) or job_id in body
    return count


@pytest.fixture
def step_queues(monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, str]]:
    with agent_queue(monkeypatch, "b", QUEUE) as mapping:
        yield mapping


def test_an_agents_steps_wait_in_its_queue_for_its_workers(
    step_queues: dict[str, str], proc_env: dict[str, str], workers: object
) -> None:
    settings = get_settings()
    broker = redis.Redis.from_url(settings.broker_url)
    with session_scope() as s:
        job, _ = create_job(s, JobCreate.model_validate(
            {"task": "queue per agent", "workflow": {"model_ids": ["b"], "subtasks": ["x"], "access_lists": [[]]}}),
            tenant="queues", settings=settings)
    send(plan_job(job.id, settings=settings))  # as the planner worker would
    assert waiting_for(broker, job.id) == 1

    with session_scope() as s:  # the message looks lost: the reconciler re-sends it, to the same queue
        step = store.get_step(s, job_id=job.id, index=0)
        assert step is not None and step.id is not None and step.status == StepStatus.QUEUED
        store.update_step(s, step_id=step.id, queued_at=utcnow() - timedelta(hours=1))
    _, dispatch = reconcile_once(settings)
    assert (job.id, 0) in dispatch.steps
    send(dispatch)
    # (counted for this job: the reconciler re-sends every stale step of agent b, an earlier test's too)
    assert waiting_for(broker, job.id) == 2
    time.sleep(1.0)  # the shared workers are running meanwhile: none of them takes the step
    with session_scope() as s:
        step = store.get_step(s, job_id=job.id, index=0)
        assert step is not None and step.status == StepStatus.QUEUED

    env = {**proc_env, "CONDUCTOR_STEP_QUEUES": json.dumps(step_queues)}
    own = start_worker(env, "obs-b", queues=QUEUE, concurrency=2)
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            with session_scope() as s:
                finished = store.get_job(s, job_id=job.id)
                if finished is not None and finished.status in JobStatus.TERMINAL:
                    break
            time.sleep(0.1)
        with session_scope() as s:
            finished = store.get_job(s, job_id=job.id)
            step = store.get_step(s, job_id=job.id, index=0)
            assert finished is not None and finished.status == JobStatus.SUCCEEDED, own.tail()
            assert step is not None and step.id is not None
            attempts = store.get_attempts(s, step_ids=[step.id])
        assert [a.worker.split("/")[0].split("@")[0] for a in attempts if a.worker] == ["obs-b"]
    finally:
        own.stop()
