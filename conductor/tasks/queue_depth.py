"""How many messages wait in each Celery queue, read from the Redis broker (for ``/metrics``)."""

from __future__ import annotations

import logging

import redis

from conductor.metrics import BrokerState, QueueDepth
from conductor.settings import Settings
from conductor.tasks.app import all_queues

log = logging.getLogger(__name__)

# kombu's Redis transport keeps one list per queue and priority level: ``steps`` for priority 0 and
# ``steps\x06\x16<n>`` for the others (its PRIORITY_STEPS and separator); a queue's depth is their sum.
PRIORITY_STEPS = (0, 3, 6, 9)
PRIORITY_SEP = "\x06\x16"
UNACKED_KEY = "unacked"
REDIS_TIMEOUT_S = 1.0


def _keys(queue: str) -> list[str]:
    return [queue if p == 0 else f"{queue}{PRIORITY_SEP}{p}" for p in PRIORITY_STEPS]


def broker_state(settings: Settings, queues: tuple[str, ...] | None = None) -> BrokerState | None:
    """Depths of ``queues`` (by default every queue the app declares) and the unacknowledged messages;
    None when the broker is not Redis (nothing to read)."""
    queues = queues or all_queues(settings)
    if not settings.broker_url.startswith(("redis://", "rediss://", "unix://")):
        return None
    client = redis.Redis.from_url(
        settings.broker_url, socket_timeout=REDIS_TIMEOUT_S, socket_connect_timeout=REDIS_TIMEOUT_S
    )
    try:
        pipe = client.pipeline(transaction=False)
        for queue in queues:
            for key in _keys(queue):
                pipe.llen(key)
        pipe.hlen(UNACKED_KEY)
        counts = [int(n) for n in pipe.execute()]
    except redis.RedisError as exc:
        log.warning("metrics: broker unreachable (%s)", type(exc).__name__)
        return BrokerState(up=False)
    finally:
        client.close()
    per_queue = len(PRIORITY_STEPS)
    depths = [
        QueueDepth(queue, sum(counts[i * per_queue:(i + 1) * per_queue])) for i, queue in enumerate(queues)
    ]
    return BrokerState(up=True, queues=depths, unacked=counts[-1])
