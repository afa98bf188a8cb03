"""Sending a task costs the broker's publish only: results live in Postgres, and no message's result is
listened for on the result backend."""

from __future__ import annotations

import gc
import uuid
from collections.abc import Callable

import redis

from conductor.settings import get_settings
from conductor.tasks.app import PLAN_TASK, app


def commands_meanwhile(action: Callable[[], object]) -> list[str]:
    """Every command the Redis server of the result backend ran while ``action`` ran (its own and other
    clients'), read with MONITOR up to a sentinel sent afterwards."""
    url = get_settings().result_backend
    sentinel = f"conductor-test-sentinel-{uuid.uuid4().hex}"
    seen: list[str] = []
    with redis.Redis.from_url(url).monitor() as monitor:
        action()
        gc.collect()  # an AsyncResult's __del__ unsubscribes: it runs now, before the sentinel
        redis.Redis.from_url(url).echo(sentinel)
        while True:
            command = str(monitor.next_command()["command"])
            if sentinel in command:
                return seen
            seen.append(command)


def test_a_task_sent_by_name_does_not_subscribe_to_its_result() -> None:
    """``send_task`` (how every message is sent: conductor/tasks/send.py, beat, embedded mode) subscribed to
    the result channel of each message on the result backend unless told the result is ignored, and the
    AsyncResult it returns unsubscribed when collected: two Redis commands per message for a result never
    stored (``task_ignore_result``). On a gevent worker the collection could fall in the hub, where the
    UNSUBSCRIBE raised BlockingSwitchOutError (a traceback in the worker's log; the channel stayed
    subscribed)."""
    task_id = f"send-test-{uuid.uuid4().hex}"
    queue = f"conductor-send-test-{uuid.uuid4().hex}"  # consumed by no worker; removed below
    try:
        commands = commands_meanwhile(lambda: app.send_task(PLAN_TASK, ("no-such-job",), task_id=task_id,
                                                            queue=queue))
        published = [c for c in commands if task_id in c]
        assert published, "the message itself was not seen: the test proved nothing"
        assert [c for c in published if "SUBSCRIBE" in c.upper()] == []
    finally:
        redis.Redis.from_url(get_settings().broker_url).delete(queue)
