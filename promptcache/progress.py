"""Progress of long work (encoding a schema, compiling): a tqdm bar on a terminal, log lines otherwise.

``progress_for(label)`` returns a ``(done, total)`` callback, the engine's ``Progress`` type.
Where stderr is a terminal it draws a tqdm bar (closed when ``done == total``); elsewhere (piped,
a server's log, a test) it logs ``label: done/total (pct%)`` at INFO on this module's logger at
most once per 10 % step, so a log file gets a handful of lines, never a bar's carriage returns.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Callable, TextIO

__all__ = ["Progress", "bar_for", "progress_for"]

log = logging.getLogger(__name__)

Progress = Callable[[int, int], None]  # (done, total) units of work; done in [0, total]


def progress_for(label: str, unit: str = "tokens", stream: TextIO | None = None) -> Progress:
    """A callback for ``label``: a bar when ``stream`` (default: stderr) is a terminal, else logging."""
    stream = stream if stream is not None else sys.stderr
    if _is_terminal(stream):
        return _Bar(label, unit, stream)
    return _LogLines(label, unit)


def bar_for(label: str, unit: str = "tokens", stream: TextIO | None = None) -> Progress | None:
    """A bar for ``label`` where ``stream`` (default: stderr) is a terminal, else None (no lines)."""
    stream = stream if stream is not None else sys.stderr
    return _Bar(label, unit, stream) if _is_terminal(stream) else None


def _is_terminal(stream) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # closed or not a real file
        return False


def _columns(stream) -> int:
    try:
        return os.get_terminal_size(stream.fileno()).columns
    except (AttributeError, OSError, ValueError):
        return 0


class _Bar:
    """A tqdm bar opened on the first call, closed when done reaches total."""

    def __init__(self, label: str, unit: str, stream: TextIO):
        self.label, self.unit, self.stream = label, unit, stream
        self.bar, self.done = None, 0

    def __call__(self, done: int, total: int) -> None:
        if self.bar is None:
            from tqdm.auto import tqdm

            ncols = None if _columns(self.stream) else 80  # a terminal reporting 0 columns draws nothing
            self.bar = tqdm(total=total, desc=self.label, unit=f" {self.unit}", file=self.stream, leave=True,
                            ncols=ncols)
        self.bar.update(max(done - self.done, 0))
        self.done = done
        if done >= total:
            self.bar.close()
            self.bar, self.done = None, 0


class _LogLines:
    """INFO lines at 0 %, every 10 % step and 100 %."""

    def __init__(self, label: str, unit: str):
        self.label, self.unit, self.step = label, unit, -1

    def __call__(self, done: int, total: int) -> None:
        pct = 100 * done // max(total, 1)
        if pct // 10 != self.step or done >= total:
            self.step = pct // 10
            log.info("%s: %d/%d %s (%d%%)", self.label, done, total, self.unit, pct)
