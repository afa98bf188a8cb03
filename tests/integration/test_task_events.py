"""A worker publishes its task events (what Flower shows) in one message per interval
(``CONDUCTOR_WORKER_EVENTS_FLUSH_S``), not one per event. Read with Celery's own event receiver, as
Flower reads them; each step here has a message of its own (continuation off), so the worker runs five
tasks, fifteen events, each separated from the next by the broker and Postgres."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
from celery.events.receiver import EventReceiver

from conductor.engine import plan_job
from conductor.settings import get_settings
from conductor.store.db import session_scope
from conductor.submission import JobCreate, create_job
from conductor.tasks.app import app
from conductor.tasks.send import send
from tests.integration.harness import agent_queue, start_worker

QUEUE = "steps-events-d"


class Counting(EventReceiver):  # type: ignore[misc]
    """Celery's receiver, counting the messages the events came in (a batch is one message, a list)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.batches: list[list[str]] = []

    def _receive(self, body: Any, message: Any, **kwargs: Any) -> None:
        events = body if isinstance(body, list) else [body]
        self.batches.append([f"{e.get('hostname')} {e.get('type')} {e.get('uuid')}" for e in events])
        super()._receive(body, message, **kwargs)


@pytest.fixture
def step_queues(monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, str]]:
    with agent_queue(monkeypatch, "d", QUEUE) as mapping:
        yield mapping


def test_a_workers_task_events_reach_a_receiver_in_one_message_per_interval(
    step_queues: dict[str, str], proc_env: dict[str, str]
) -> None:
    env = {**proc_env, "CONDUCTOR_STEP_QUEUES": json.dumps(step_queues), "CONDUCTOR_WORKER_CONTINUE_STEPS": "false",
           "CONDUCTOR_WORKER_EVENTS_FLUSH_S": "3"}
    own = start_worker(env, "batched", queues=QUEUE, concurrency=2)
    try:
        with app.connection_for_read() as conn:
            receiver = Counting(conn, handlers={}, app=app)
            listening = threading.Thread(target=lambda: receiver.capture(limit=None, timeout=None, wakeup=False),
                                         daemon=True)
            listening.start()
            time.sleep(1.0)  # the receiver's queue is bound to the events exchange before anything is sent
            body = {"task": "events", "workflow": {"model_ids": ["d"] * 5, "subtasks": [f"part {i}" for i in range(5)],
                                                   "access_lists": [[i - 1] if i else [] for i in range(5)]}}
            with session_scope() as s:
                job, _ = create_job(s, JobCreate.model_validate(body), tenant="events", settings=get_settings())
            send(plan_job(job.id, settings=get_settings()))

            def mine() -> list[list[str]]:
                return [[e for e in batch if e.startswith("batched@") and " task-" in e] for batch in receiver.batches]

            deadline = time.monotonic() + 30
            while sum(len(b) for b in mine()) < 15 and time.monotonic() < deadline:
                time.sleep(0.1)
            time.sleep(0.5)  # anything more would arrive now
            receiver.should_stop = True
            listening.join(5)
        batches = [b for b in mine() if b]
        events = [e for b in batches for e in b]
        kinds = ["task-received", "task-started", "task-succeeded"]
        assert sorted(e.split(" ")[1] for e in events) == sorted(kinds * 5)
        # Events are sent in windows (3 s), not one message each (Celery's own flush on the next turn of its
        # loop): fewer messages than events, and some task's three events (received, started, succeeded,
        # milliseconds apart) share one (a task across a window's end may not). How many windows the run
        # spans depends on the machine's speed.
        kinds_by_task = [{(e.split(" ")[2], e.split(" ")[1]) for e in b} for b in batches]
        whole = [task for pairs in kinds_by_task for task, _ in pairs
                 if all((task, kind) in pairs for kind in kinds)]
        assert len(batches) < len(events) and whole, batches
    finally:
        own.stop()
