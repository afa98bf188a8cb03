"""``conductor worker`` keeps its Celery worker alive.

The last resort for a Celery worker that exits on its own: a crash, the OOM killer, Celery giving up on the
broker after ``broker_connection_max_retries``. Losing Redis no longer ends it (it exited as "Unrecoverable
error", ``'NoneType' object has no attribute 'hostname'``, with code 0, until ``conductor/tasks/transport.py``
kept its channel's pool parameters; docs/architecture.md, Worker supervision). The work is safe either way
(Postgres holds the state and the reconciler re-drives it), but a dead worker runs nothing. So the worker
runs as a child process and is restarted, with backoff, whenever it exits without having been asked to:
only a stop (SIGTERM/SIGINT to the supervisor, forwarded to the child as SIGTERM) ends both."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from types import FrameType

MAX_BACKOFF_S = 30.0
HEALTHY_AFTER_S = 60.0
"""A child that ran this long before exiting counts as healthy: the backoff starts over."""


def supervise(argv: Sequence[str], *, sleep: float = 1.0, max_restarts: int | None = None) -> int:
    """Runs ``argv``, restarting it whenever it exits, until the supervisor is asked to stop (or, with
    ``max_restarts``, gives up); returns the last exit code."""
    stopping = False
    child: subprocess.Popen[bytes] | None = None

    def forward(_signum: int, _frame: FrameType | None) -> None:
        nonlocal stopping
        stopping = True
        if child is not None and child.poll() is None:
            # Always SIGTERM, Celery's warm shutdown however often it comes: a terminal's Ctrl-C reaches the
            # child too (one process group), and a second SIGINT from here would make it a cold shutdown,
            # killing the steps it runs. A second Ctrl-C still reaches the child itself, for a cold one.
            child.send_signal(signal.SIGTERM)

    previous = {s: signal.signal(s, forward) for s in (signal.SIGTERM, signal.SIGINT)}
    failures = 0
    try:
        while True:
            started = time.monotonic()
            child = subprocess.Popen(list(argv))
            code = child.wait()
            if stopping:
                return code
            failures = 1 if time.monotonic() - started > HEALTHY_AFTER_S else failures + 1
            if max_restarts is not None and failures > max_restarts:
                return code
            delay = min(MAX_BACKOFF_S, sleep * 2 ** (failures - 1))
            print(f"conductor worker: the Celery worker exited with code {code}; restarting in {delay:.0f}s "
                  f"(restart {failures})", file=sys.stderr, flush=True)
            time.sleep(delay)
            if stopping:
                return code
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
