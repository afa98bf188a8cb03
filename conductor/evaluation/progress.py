"""A progress bar for many jobs: redrawn in place on a terminal, a line every few seconds otherwise."""

from __future__ import annotations

import time
from typing import TextIO

BAR_WIDTH = 30
LINE_EVERY_S = 10.0


class ProgressBar:
    def __init__(self, total: int, err: TextIO, *, label: str = "jobs"):
        self.total = max(total, 0)
        self.err = err
        self.label = label
        self.done = 0
        self.correct = 0
        self.started = time.monotonic()
        self.tty = err.isatty()
        self._last_line = 0.0
        self._width = 0

    def advance(self, *, correct: bool, running: int) -> None:
        self.done += 1
        self.correct += int(correct)
        self.draw(running=running, force=self.done == self.total)

    def draw(self, *, running: int, force: bool = False) -> None:
        text = self._text(running)
        if self.tty:
            self.err.write("\r" + text.ljust(self._width))
            self.err.flush()
            self._width = len(text)
        elif force or time.monotonic() - self._last_line >= LINE_EVERY_S:
            print(text, file=self.err, flush=True)
            self._last_line = time.monotonic()

    def close(self) -> None:
        if self.tty and self._width:
            self.err.write("\n")
            self.err.flush()
            self._width = 0

    def _text(self, running: int) -> str:
        fraction = self.done / self.total if self.total else 1.0
        filled = int(BAR_WIDTH * fraction)
        elapsed = time.monotonic() - self.started
        eta = f"{elapsed / self.done * (self.total - self.done):.0f}s" if self.done else "?"
        return (
            f"[{'#' * filled}{'.' * (BAR_WIDTH - filled)}] {self.done}/{self.total} {self.label} "
            f"{100 * fraction:3.0f}% | {self.correct} correct | {running} running | "
            f"{elapsed:.0f}s elapsed, eta {eta}"
        )
