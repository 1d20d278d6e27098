"""After a request with a large body is answered, freed heap pages go back to the OS
(``TrimAfterLarge``, an ASGI middleware, and the ``Trimmer`` thread it asks).

Why. glibc keeps memory a program frees inside its arenas (one per thread that allocates, up
to eight per core) and returns it to the OS only from the top of an arena. A large body is a
large transient: a 2M-character prompt to tokenize (the tokenizer's encoding, half a million
Python ints, the JSON answer: ~200-300 MB for a moment), ~7 MB of token ids to detokenize, a
long chat. Freed when its answer is sent, much of it stayed resident whenever a small live
allocation sat above it, and the serving process grew by tens of MB with each such request in
the soak (eval/results/reliability.md). ``malloc_trim(0)`` walks every arena and gives back each
whole free page (the schema encoder's ``release_free_memory``; a no-op without glibc or on GPU).

What it costs: the trim holds each arena's lock while it walks it (milliseconds to tens of
milliseconds on a 2 GB process), so it runs on a thread of its own, never on the event loop,
and only after large requests, not on a timer.
"""

from __future__ import annotations

import logging
import threading
import time

import torch

from ..engine.schemas.encoder import release_free_memory

log = logging.getLogger(__name__)

__all__ = ["LARGE_BODY", "TrimAfterLarge", "Trimmer"]

LARGE_BODY = 2**20  # bytes of a request body from which its answer is followed by a trim


class Trimmer:
    """Trims on a daemon thread of its own: ``after_large()`` asks for a trim and returns at
    once; asks that come while one runs, or within ``gap`` seconds after it, are served by one
    more trim at the end of the gap (a burst of large requests pays two trims, and the last
    one's frees are always given back). ``trims``: how many ran."""

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
            release_free_memory(torch.device("cpu"))
            self.trims += 1
            log.debug("malloc_trim after a large request: %.1f ms", 1e3 * (time.perf_counter() - t0))
            time.sleep(self.gap)


class TrimAfterLarge:
    """ASGI middleware: counts a request's body bytes as they are received and, once it is
    answered (or failed), asks ``trimmer`` when they reached ``large``."""

    def __init__(self, app, trimmer: Trimmer, large: int = LARGE_BODY):
        self.app, self.trimmer, self.large = app, trimmer, large

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        size = 0

        async def counted():
            nonlocal size
            message = await receive()
            size += len(message.get("body", b""))
            return message

        try:
            await self.app(scope, counted, send)
        finally:
            if size >= self.large:
                self.trimmer.after_large()
