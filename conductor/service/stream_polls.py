"""What the two progress streams share (chat completion chunks, ``routes/openai_chat.py``; job events,
``routes/jobs.py``): each polls its job's state from a worker thread, with a short session per poll.

Each holds one of its tenant's stream slots (``quotas.open_stream``) and gives it back when it ends,
from a worker thread and shielded from the cancellation of a client that left (``release_slot``).

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

import anyio
from fastapi.concurrency import run_in_threadpool

from conductor.quotas import close_stream
from conductor.settings import Settings
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


async def release_slot(tenant: str, slot: str, settings: Settings) -> None:
    """``close_stream`` on a worker thread: with Redis unreachable it blocks for its timeouts, which on the
    event loop froze every request of the process, at each stream's end. Shielded: a stream ending
    because its client left is being cancelled, and the release must still be sent (a slot not
    released holds a place of the tenant's until it expires)."""
    with anyio.CancelScope(shield=True):
        await anyio.to_thread.run_sync(close_stream, tenant, slot, settings)
