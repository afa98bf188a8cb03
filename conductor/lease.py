"""Leases and the heartbeat that renews them.

A claimed step holds a short lease (``step_lease_s``, 30 s by default). While this process works on
the step (the provider call, retry waits, rate-limit waits) one heartbeat thread per process renews
every lease it holds, all in one statement, every third of the lease. A worker that dies stops
renewing, so its steps are re-claimable a lease later and the reconciler re-sends them: a SIGKILLed
worker's step runs again within ``step_lease_s + reconcile_interval_s`` instead of after a long lease
that had to cover the slowest call. Under gevent the thread is a greenlet, as cooperative as the calls.

The same heartbeat keeps a planning alive: while a planner call runs (it may take longer than any
lease), the job's ``updated_at`` is renewed under its planning claim, so the reconciler re-drives a
planning only when its worker stopped beating (``planning_stale_s``), never a slow planner that runs --
up to the longest a planning can take (every planner call at its full timeout and retries); a planner
past that is stuck, stops being renewed and is re-driven like a dead one.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TypeVar

from sqlmodel import Session

from conductor.store import jobs as store
from conductor.store.db import transaction

log = logging.getLogger(__name__)
K = TypeVar("K")
V = TypeVar("V")


class Heartbeat:
    """Renews the leases this process holds while it holds them."""

    def __init__(self, lease_s: float):
        self.lease_s = lease_s
        self.interval_s = lease_s / 3
        self._held: dict[int, str] = {}
        self._until: dict[int, float] = {}
        self._planning: dict[str, int] = {}
        self._planning_until: dict[str, float] = {}
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None

    @contextmanager
    def holding(self, step_id: int, owner: str, *, for_s: float | None = None) -> Iterator[None]:
        """Keeps ``step_id``'s lease (claimed as ``owner``) alive until the block ends, or for at most
        ``for_s`` seconds: a step still in its block after that is stuck (a call that ignores its
        timeout), so its lease is left to expire and the reconciler hands the step to another worker
        (this one's late outcome is fenced off by the claim)."""
        with self._lock:
            self._held[step_id] = owner
            if for_s is not None:
                self._until[step_id] = time.monotonic() + for_s
            self._start()
        try:
            yield
        finally:
            with self._lock:
                if self._held.get(step_id) == owner:
                    del self._held[step_id]
                    self._until.pop(step_id, None)

    @contextmanager
    def planning(self, job_id: str, claim: int, *, for_s: float | None = None) -> Iterator[None]:
        """Keeps ``job_id``'s planning (claim number ``claim``) alive until the block ends, or for at most
        ``for_s`` seconds: a planner still running after that is stuck, so the job is left to look silent
        and the reconciler re-drives its planning (this claim's late plan is fenced off)."""
        with self._lock:
            self._planning[job_id] = claim
            if for_s is not None:
                self._planning_until[job_id] = time.monotonic() + for_s
            self._start()
        try:
            yield
        finally:
            with self._lock:
                if self._planning.get(job_id) == claim:
                    del self._planning[job_id]
                    self._planning_until.pop(job_id, None)

    def _start(self) -> None:
        if self._thread is None or not self._thread.is_alive():
            self._thread = threading.Thread(target=self._run, name="conductor-heartbeat", daemon=True)
            self._thread.start()

    def held(self) -> list[tuple[int, str]]:
        """The leases to renew: every held one not past its ``for_s``."""
        return self._within(self._held, self._until, "step %s ran past its longest possible duration; its "
                            "lease is left to expire")

    def plannings(self) -> list[tuple[str, int]]:
        """The plannings to keep alive: every one not past its ``for_s``."""
        return self._within(self._planning, self._planning_until, "planning job %s ran past its longest "
                            "possible duration; it is left to be re-driven")

    def _within(self, kept: dict[K, V], until: dict[K, float], overdue_warning: str) -> list[tuple[K, V]]:
        """``kept``'s entries, after dropping (with a warning) those past their deadline in ``until``."""
        now = time.monotonic()
        with self._lock:
            for key in [key for key, deadline in until.items() if deadline < now]:
                log.warning(overdue_warning, key)
                kept.pop(key, None)
                del until[key]
            return list(kept.items())

    def beat(self) -> int:
        """One renewal of every held lease and planning; returns how many were still held in the store."""
        held, planning = self.held(), self.plannings()
        if not held and not planning:
            return 0

        def renew(s: Session) -> int:
            return store.renew_leases(s, held=held, seconds=self.lease_s) + store.renew_planning(s, held=planning)

        return transaction(renew, reserved=True)  # its own connection: a full pool cannot starve it

    def _run(self) -> None:
        while not self._wake.wait(self.interval_s):
            try:
                self.beat()
            except Exception as exc:  # the database is down: the next beat tries again
                log.warning("lease heartbeat failed (%s: %s)", type(exc).__name__, exc)


_heartbeats: dict[float, Heartbeat] = {}
_heartbeats_lock = threading.Lock()


def heartbeat(lease_s: float) -> Heartbeat:
    """This process's heartbeat for leases of ``lease_s`` seconds."""
    with _heartbeats_lock:
        if lease_s not in _heartbeats:
            _heartbeats[lease_s] = Heartbeat(lease_s)
        return _heartbeats[lease_s]
