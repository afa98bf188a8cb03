"""A bare Celery app of no-op tasks on the benchmarks' broker: the substrate's own cost per hop.

Each task appends the time it ran to the list it was given, so a chain returns every step's time.
"""

from __future__ import annotations

import os
import time

from celery import Celery

BROKER = os.environ.get("CONDUCTOR_BENCH_BROKER_URL", "redis://127.0.0.1:6379/3")

app = Celery("bench_noop", broker=BROKER, backend=BROKER)
app.conf.update(task_serializer="json", result_serializer="json", accept_content=["json"],
                task_default_queue="noop", worker_prefetch_multiplier=1, task_acks_late=True,
                worker_hijack_root_logger=False, broker_connection_retry_on_startup=True)


@app.task(name="bench.noop")
def noop(stamps: list[float]) -> list[float]:
    return [*stamps, time.time()]


@app.task(name="bench.join")
def join(parts: list[list[float]]) -> list[float]:
    """A chord body: the header tasks' stamps (flattened, in header order), then its own."""
    merged: list[float] = []
    for part in parts:
        merged += [s for s in part if s not in merged]
    return [*merged, time.time()]
