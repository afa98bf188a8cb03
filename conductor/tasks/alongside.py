"""A worker process's local slots: parallel steps that became ready together (a plan's roots, a step's
dependents) and were claimed for this worker with the transaction that made them ready run here, at
once, beside the task that claimed them — instead of a message each through the broker and a claim
transaction each on whichever worker takes it (``Settings.worker_local_slots``).

Every step started holds one slot until its run (and the chain it continues) ends, and there are never
more slots than threads, so a started step never waits for a thread. ``spare()`` is what a claim may
count on; another task may take a slot between that read and ``start``, and then ``start`` says so and
the claiming task runs the step itself, after its own.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

THREAD_PREFIX = "alongside"


class LocalSlots:
    def __init__(self, size: int):
        self.size = size
        self._free = size
        self._lock = threading.Lock()
        self._executor: ThreadPoolExecutor | None = None

    def spare(self) -> int:
        """Free slots now (a hint: see the module's docstring)."""
        return self._free

    def start(self, fn: Callable[..., Any], *args: Any) -> Future[Any] | None:
        """Runs ``fn(*args)`` on a free slot; None when there is none (the caller runs it itself)."""
        with self._lock:
            if self._free <= 0:
                return None
            self._free -= 1
            if self._executor is None:  # made in the process that runs tasks (after a prefork pool's fork)
                self._executor = ThreadPoolExecutor(max_workers=self.size, thread_name_prefix=THREAD_PREFIX)
            executor = self._executor
        try:
            return executor.submit(self._run, fn, args)
        except BaseException:
            self._release()
            raise

    def _run(self, fn: Callable[..., Any], args: tuple[Any, ...]) -> Any:
        try:
            return fn(*args)
        finally:
            self._release()

    def _release(self) -> None:
        with self._lock:
            self._free += 1


_slots: dict[int, LocalSlots] = {}
_slots_lock = threading.Lock()


def local_slots(size: int) -> LocalSlots:
    """This process's local slots (``size`` of them: ``Settings.worker_local_slots``)."""
    with _slots_lock:
        if size not in _slots:
            _slots[size] = LocalSlots(size)
        return _slots[size]
