"""Runs untrusted Python (a model's answer plus tests) in a subprocess with a timeout and limits.

The code runs as ``python -I`` (no user site, no PYTHON* variables) in an empty temporary directory
with an empty environment, under CPU-time, memory, file-size and process-count limits; its whole process
group is killed when it ends or at the timeout (a process that starts its own session outlives that).
That contains accidents and runaway loops; it is not a security boundary against hostile code: score
untrusted models' code on a machine you can spare.
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
from typing import IO

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
    """Runs ``program``; passed means it exited 0 within ``timeout_s``. Its output goes to a file, not a
    pipe, so a process it leaves behind holds nothing open: the run ends when the program does, and the
    whole process group is killed then. Output past the file-size limit (16 MB) ends the program."""
    with tempfile.TemporaryDirectory(prefix="conductor-eval-") as directory, tempfile.TemporaryFile() as out:
        Path(directory, PROGRAM_FILE).write_text(program, encoding="utf-8")
        cmd = [sys.executable, "-I", "-c", _LAUNCHER, str(max(1, int(timeout_s) + 1))]
        proc = subprocess.Popen(
            cmd,
            cwd=directory,
            env={"PATH": os.defpath, "PYTHONHASHSEED": "0"},
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own process group: the kill below reaches what it spawned too
        )
        try:
            proc.wait(timeout=timeout_s)
            timed_out = False
        except subprocess.TimeoutExpired:
            timed_out = True
        _kill_group(proc)  # at the timeout the program itself; else what it left running in its group
        proc.wait()
        output = _tail(out)
    if timed_out:
        return RunResult(False, None, output + f"\n(killed after {timeout_s:g}s)")
    return RunResult(proc.returncode == 0, proc.returncode, output)


def _kill_group(proc: subprocess.Popen[bytes]) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)


def _tail(out: IO[bytes]) -> str:
    size = out.seek(0, os.SEEK_END)
    out.seek(max(0, size - 4 * OUTPUT_KEEP_CHARS))  # UTF-8: at most 4 bytes a character
    return out.read().decode("utf-8", "replace")[-OUTPUT_KEEP_CHARS:]
