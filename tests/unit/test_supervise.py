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
