"""What the two progress streams share (chat completion chunks, ``routes/openai_chat.py``; job events,
``routes/jobs.py``): each polls its job's state from a worker thread, with a short session per poll.

A poll reads only what a stream sends while the job runs (statuses: ``store.job_progress``), and the
answer once, when the job has ended; it comes sooner after a change and less often while nothing
changes (``Pace``), and looks the stream's API key up again every ``KEY_CHECK_S``, not at each poll: a
thousand open streams on jobs that run for minutes cost the database a few hundred small reads a
second, not thousands of whole job rows.

Each holds one of its tenant's stream slots (``quotas.open_stream``) and gives it back when its response
ends, however it ends (``SlotStream``), from a worker thread and shielded from the cancellation of a
client that left (``release_slot``).

A poll that finds the database away (``DATABASE_AWAY``: down, restarting, every pooled connection busy)
is tried again for a few seconds, so that a restart or a failover does not end every open stream; past
that the stream ends with an error event naming its job, which goes on (the client reads it later with
``GET /v1/jobs/{id}``) rather than with a dropped connection.
"""

from __future__ import annotations

import asyncio
import logging
import math
import random
import time
from collections.abc import AsyncGenerator, Callable, Mapping
from typing import TypeVar

import anyio
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from conductor.quotas import close_stream
from conductor.settings import Settings
from conductor.store.db import DATABASE_AWAY, driver_reason

T = TypeVar("T")
log = logging.getLogger(__name__)

DATABASE_PATIENCE_S = 10.0
"""A poll meeting the database away is tried again (after 0.5 s, doubling) while its next try would
start within this long of its first; then the failure is raised and the stream ends."""
FIRST_RETRY_S = 0.5
POLL_FIRST_S = 0.25
POLL_LONGEST_S = 2.0
KEY_CHECK_S = 5.0
"""A stream whose key was revoked ends within about this long (and one poll)."""


class Pace:
    """When a stream polls next, and whether that poll looks its API key up again."""

    def __init__(self) -> None:
        self.wait = POLL_FIRST_S
        self._key_checked = -math.inf

    def key_due(self) -> bool:
        """True once every ``KEY_CHECK_S`` (the first time at once)."""
        now = time.monotonic()
        if now - self._key_checked < KEY_CHECK_S:
            return False
        self._key_checked = now
        return True

    def after(self, changed: bool) -> float:
        """The wait before the next poll: ``POLL_FIRST_S`` after a poll that found a change, else twice
        the last wait, up to ``POLL_LONGEST_S`` (a change is sent at most that late); each shortened by up
        to a quarter at random, so that streams opened together do not poll together."""
        self.wait = POLL_FIRST_S if changed else min(self.wait * 2, POLL_LONGEST_S)
        return self.wait * random.uniform(0.75, 1.0)


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


class SlotStream(StreamingResponse):
    """A server-sent event stream holding its tenant's stream slot ``slot``, given back when the response
    ends: finished, failed, or its client gone at any moment. Released by the body's generator alone (in
    its ``finally``), the slot outlived a client that left early: one gone while the response's first
    message was being sent (uvicorn's ``send`` waits while the connection takes no more writes) cancelled
    the response before its body was iterated, so the generator never started, its ``finally`` never ran,
    and the slot kept a place of the tenant's until it lapsed (``STREAM_TTL_S``); one gone while an event
    was being sent left the generator suspended at its ``yield``, closed only when garbage-collected. Here
    the generator is closed as the response ends (its ``finally`` runs then) and the slot released,
    shielded from the cancellation that ended it."""

    def __init__(self, events: AsyncGenerator[str, None], *, tenant: str, slot: str, settings: Settings,
                 headers: Mapping[str, str] | None = None):
        super().__init__(events, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **(headers or {})})
        self.events, self.tenant, self.slot, self.settings = events, tenant, slot, settings

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            with anyio.CancelScope(shield=True):
                try:
                    await self.events.aclose()
                finally:
                    await release_slot(self.tenant, self.slot, self.settings)  # (not released: it lapses)
