"""Runs untrusted Python (a model's answer plus tests) in a subprocess with a timeout and limits.

The code runs as ``python -I`` (no user site, no PYTHON* variables) in an empty temporary directory
with an empty environment, under CPU-time, memory, file-size and process-count limits, and is killed
with its whole process group at the timeout. That contains accidents and runaway loops; it is not a
security boundary against hostile code: score untrusted models' code on a machine you can spare.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

MEMORY_LIMIT_BYTES = 1 << 30
FILE_SIZE_LIMIT_BYTES = 16 << 20
MAX_PROCESSES = 64
OUTPUT_KEEP_CHARS = 2_000
PROGRAM_FILE = "program.py"
# Applies the limits, then runs program.py as __main__ (so doctest.testmod() and `if __name__` work).
_LAUNCHER = f"""
import resource, runpy, sys
cpu = int(sys.argv[1])
resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
resource.setrlimit(resource.RLIMIT_AS, ({MEMORY_LIMIT_BYTES}, {MEMORY_LIMIT_BYTES}))
resource.setrlimit(resource.RLIMIT_FSIZE, ({FILE_SIZE_LIMIT_BYTES}, {FILE_SIZE_LIMIT_BYTES}))
try:
    resource.setrlimit(resource.RLIMIT_NPROC, ({MAX_PROCESSES}, {MAX_PROCESSES}))
except (ValueError, OSError):
    pass
sys.argv = ["{PROGRAM_FILE}"]
runpy.run_path("{PROGRAM_FILE}", run_name="__main__")
"""


@dataclass(frozen=True)
class RunResult:
    passed: bool
    returncode: int | None
    """None when it was killed at the timeout."""
    output: str
    """The tail of stdout and stderr, for the report."""

    @property
    def timed_out(self) -> bool:
        return self.returncode is None


def run_python(program: str, *, timeout_s: float) -> RunResult:
    """Runs ``program``; passed means it exited 0 within ``timeout_s``."""
    with tempfile.TemporaryDirectory(prefix="conductor-eval-") as directory:
        Path(directory, PROGRAM_FILE).write_text(program, encoding="utf-8")
        cmd = [sys.executable, "-I", "-c", _LAUNCHER, str(max(1, int(timeout_s) + 1))]
        proc = subprocess.Popen(
            cmd,
            cwd=directory,
            env={"PATH": os.defpath, "PYTHONHASHSEED": "0"},
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own process group: the timeout kills what it spawned too
        )
        try:
            out, _ = proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            _kill_group(proc)
            out, _ = proc.communicate()
            return RunResult(False, None, _tail(out) + f"\n(killed after {timeout_s:g}s)")
    return RunResult(proc.returncode == 0, proc.returncode, _tail(out))


def _kill_group(proc: subprocess.Popen[bytes]) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)


def _tail(out: bytes | None) -> str:
    text = (out or b"").decode("utf-8", "replace")
    return text[-OUTPUT_KEEP_CHARS:]
