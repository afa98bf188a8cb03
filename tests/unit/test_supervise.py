"""The worker supervisor restarts a crashed worker and stops with a clean exit."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from conductor.tasks.supervise import supervise

CRASH_TWICE = """
import sys, pathlib
runs = pathlib.Path(sys.argv[1])
n = int(runs.read_text() or 0) + 1 if runs.exists() else 1
runs.write_text(str(n))
sys.exit({1: 70, 2: 0}.get(n, 3))
"""


def test_a_worker_that_exits_unasked_is_restarted_even_with_code_0(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Celery reports an "Unrecoverable error" with exit code 0, so no exit code means "done".
    runs = tmp_path / "runs"
    assert supervise([sys.executable, "-c", CRASH_TWICE, str(runs)], sleep=0.01, max_restarts=2) == 3
    assert runs.read_text() == "3"
    err = capsys.readouterr().err
    assert "exited with code 70; restarting" in err and "exited with code 0; restarting" in err


RECORD_SIGNALS = """
import pathlib, signal, sys, time
log = pathlib.Path(sys.argv[1])
def record(signum, _frame):
    with log.open("a") as f:
        f.write(signal.Signals(signum).name + "\\n")
signal.signal(signal.SIGINT, record)
signal.signal(signal.SIGTERM, record)
log.with_suffix(".ready").write_text("1")
end = time.monotonic() + 3
while time.monotonic() < end:
    time.sleep(0.05)
"""


def test_ctrl_c_gives_the_worker_one_sigint_and_a_sigterm_never_two_sigints(tmp_path: Path) -> None:
    """Ctrl-C signals the terminal's whole process group: the Celery child gets that SIGINT (a warm
    shutdown), and what the supervisor forwards must not be a second SIGINT (a cold one, killing the
    steps the worker runs)."""
    import os
    import signal
    import subprocess
    import time

    log = tmp_path / "signals"
    code = ("import sys; from conductor.tasks.supervise import supervise; "
            f"sys.exit(supervise([sys.executable, '-c', {RECORD_SIGNALS!r}, {str(log)!r}]))")
    proc = subprocess.Popen([sys.executable, "-c", code], start_new_session=True)  # a terminal's group
    try:
        deadline = time.monotonic() + 30
        while not log.with_suffix(".ready").exists():
            assert time.monotonic() < deadline and proc.poll() is None, "the child never started"
            time.sleep(0.02)
        os.killpg(proc.pid, signal.SIGINT)  # what Ctrl-C does
        assert proc.wait(timeout=30) == 0  # the child ran out its time and exited; the supervisor with it
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert sorted(log.read_text().split()) == ["SIGINT", "SIGTERM"]
