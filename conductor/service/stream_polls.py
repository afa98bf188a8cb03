"""What the two progress streams share (chat completion chunks, ``routes/openai_chat.py``; job events,
``routes/jobs.py``): each polls its job's state from a worker thread, with a short session per poll.

A poll that finds the database away (``DATABASE_AWAY``: down, restarting, every pooled connection busy)
is tried again for a few seconds, so that a restart or a failover does not end every open stream; past
that the stream ends with an error event naming its job, which goes on (the client reads it later with
``GET /v1/jobs/{id}``) rather than with a dropped connection.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import TypeVar

from fastapi.concurrency import run_in_threadpool

from conductor.store.db import DATABASE_AWAY, driver_reason

T = TypeVar("T")
log = logging.getLogger(__name__)

DATABASE_PATIENCE_S = 10.0
"""A poll meeting the database away is tried again (after 0.5 s, doubling) while its next try would
start within this long of its first; then the failure is raised and the stream ends."""
FIRST_RETRY_S = 0.5


async def poll(read: Callable[[], T], *, job_id: str) -> T:
    """``read()`` on the thread pool, tried again while the database is away (``DATABASE_PATIENCE_S``)."""
    deadline = time.monotonic() + DATABASE_PATIENCE_S
    wait = FIRST_RETRY_S
    while True:
        try:
            return await run_in_threadpool(read)
        except DATABASE_AWAY as exc:
            if time.monotonic() + wait > deadline:
                raise
            log.warning("stream of job %s: database away (%s: %s); polling again in %.1f s", job_id,
                        type(exc).__name__, driver_reason(exc), wait)
            await asyncio.sleep(wait)
            wait *= 2


def failure_reason(job_id: str, exc: BaseException) -> str:
    """What a stream's error event says of the failure that ended it (its type); anything but the
    database away is a bug, logged with its traceback."""
    if not isinstance(exc, DATABASE_AWAY):
        log.error("stream of job %s: its poll failed", job_id, exc_info=exc)
    return type(exc).__name__
