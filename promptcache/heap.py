"""Give freed heap memory back to the OS: glibc's ``malloc_trim`` (a no-op where there is none).

Why. glibc keeps memory a program frees inside its arenas (one per thread that allocates, up
to eight per core) and returns it to the OS only from the top of an arena. A large transient
allocation (a 2M-character prompt tokenized: the tokenizer's encoding, half a million Python
ints, the JSON answer; ~200-300 MB for a moment) leaves its pages resident after it is freed
whenever a small live allocation sits above them, so each large request left the serving
process tens of MB larger (eval/results/reliability.md measured it). ``malloc_trim(0)`` walks
every arena and gives back each whole free page (``madvise``).

What it costs: it holds each arena's lock while it walks it, so other threads' allocations
wait. On a 2 GB serving process it takes milliseconds to tens of milliseconds, which is why
callers trim after large frees (``release_free_memory`` with a reason), not on a timer.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import threading
import time

log = logging.getLogger(__name__)

__all__ = ["release_free_memory", "Trimmer"]


def _libc():
    name = ctypes.util.find_library("c")
    try:
        return ctypes.CDLL(name) if name else None
    except OSError:
        return None


_TRIM = getattr(_libc(), "malloc_trim", None)


def release_free_memory() -> bool:
    """Give freed heap pages back to the OS; False where the C library has no ``malloc_trim``."""
    if _TRIM is None:
        return False
    _TRIM(0)
    return True


class Trimmer:
    """Trims on a daemon thread of its own after large frees: ``after_large()`` asks for a trim
    and returns at once; asks that come while one runs, or within ``gap`` seconds after it, are
    served by one more trim at the end of the gap (a burst of large requests pays two trims,
    and the last one's frees are always given back)."""

    def __init__(self, gap: float = 2.0, name: str = "promptcache-trim"):
        if gap < 0:
            raise ValueError(f"Trimmer.gap must be >= 0 seconds, got {gap}")
        self.gap, self.trims = gap, 0
        self._asked = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def after_large(self) -> None:
        """A large request is done (its memory freed): trim soon."""
        self._asked.set()

    def _run(self) -> None:
        while True:
            self._asked.wait()
            self._asked.clear()
            t0 = time.perf_counter()
            if not release_free_memory():
                return  # nothing to trim with: the thread ends, later asks are only flags
            self.trims += 1
            log.debug("malloc_trim after a large request: %.1f ms", 1e3 * (time.perf_counter() - t0))
            time.sleep(self.gap)
