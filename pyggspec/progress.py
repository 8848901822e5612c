"""Progress lines on stderr that suit where stderr goes.

On a terminal a bar is redrawn in place with carriage returns. Anywhere else (a pipe, a log
file, CI) those frames would pile up as hundreds of lines, so each phase writes one line when
it starts and one when it ends instead.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import TextIO

Frame = Callable[[int, int, float], str]  # (done, total, seconds since start) -> one line


def is_terminal(stream: TextIO | None) -> bool:
    """Whether ``stream`` is an interactive terminal (False for anything that cannot say)."""
    try:
        return bool(stream is not None and stream.isatty())
    except (AttributeError, ValueError, OSError):
        return False


class Progress:
    """One phase of work with ``total`` units, reported on ``stream`` (default stderr).

    ``frame`` renders the bar; ``header`` is printed once as its own line in both modes;
    ``start`` is printed when not live (a terminal gets the bar right away instead).
    ``live`` defaults to whether the stream is a terminal.
    """

    def __init__(self, total: int, frame: Frame, *, start: str | None = None,
                 header: str | None = None, stream: TextIO | None = None,
                 live: bool | None = None, interval: float = 0.1) -> None:
        self.stream = stream if stream is not None else sys.stderr
        self.live = is_terminal(self.stream) if live is None else live
        self.total, self.frame, self.interval = total, frame, interval
        self.done = 0
        self.t0 = self.last = time.monotonic()
        self.finished = False
        if header is not None:
            self._write(header + "\n")
        if self.live:
            self._write("\r" + self._render())
        elif start is not None:
            self._write(start + "\n")

    def _render(self) -> str:
        return self.frame(self.done, self.total, time.monotonic() - self.t0)

    def _write(self, s: str) -> None:
        self.stream.write(s)
        self.stream.flush()

    def update(self, n: int = 1) -> None:
        """Count ``n`` more units done; a live bar redraws at most every ``interval`` s."""
        self.set(self.done + n)

    def set(self, done: int) -> None:
        self.done = done
        if not self.live or self.finished:
            return
        now = time.monotonic()
        if now - self.last >= self.interval:
            self.last = now
            self._write("\r" + self._render())

    def finish(self) -> None:
        """End the phase: the last frame on its own line (once, also after an error)."""
        if self.finished:
            return
        self.finished = True
        self._write(("\r" if self.live else "") + self._render() + "\n")
