"""The seam between the HTTP layer and the engine: one worker thread owns the model.

Requests arrive as ``Job``s (a ``start(reserve) -> PrefillResult`` callable and sampling
settings). The worker admits them and steps every active job's ``GenerationStream`` iterator in
turn (round-robin, one step each: a step is the prefill, or decoding until the next text piece),
so no request waits for another's whole generation. Each step's outcome goes back to the
request's asyncio loop as an event:

    ("prefilled", PrefillResult)  after the prompt ran (usage, TTFT)
    ("text", str)                 a decoded text piece
    ("done", Generation)          finished; the cache is back in the engine's pool
    ("error", Exception)          failed; nothing more follows

Capacity: at most ``max_queue`` jobs are admitted at once (decoding or waiting for their first
step); ``submit`` raises ``QueueFull`` beyond that (the server answers 503). ``cancel`` closes the
job's iterator on the worker thread, which returns its cache to the pool.

Later (continuous batching), the engine's scheduler replaces ``_step_all``: the worker then
hands all active requests to one batched decode step; ``Job``/``submit``/``cancel`` and the
events stay as they are.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

from ..errors import PromptCacheError

log = logging.getLogger(__name__)


class QueueFull(PromptCacheError, RuntimeError):
    """More requests than ``max_queue`` are in flight."""

    exit_code = 2


@dataclass
class Sampling:
    max_new_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    stop: list[str] | None = None
    seed: int | None = None


@dataclass
class Job:
    start: Callable[[int], object]  # start(reserve) -> PrefillResult holding its cache
    sampling: Sampling
    loop: asyncio.AbstractEventLoop | None = None
    events: asyncio.Queue | None = None
    cancelled: bool = False
    submitted: float = field(default_factory=time.perf_counter)
    _it: object = field(default=None, repr=False)
    _stream: object = field(default=None, repr=False)

    def emit(self, kind: str, value) -> None:
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, (kind, value))
        except RuntimeError:  # the request's event loop is gone (server shutting down)
            pass


class Backend:
    """Owns the engine; ``submit`` from the event loop, events back through ``job.events``."""

    def __init__(self, pc, max_queue: int = 64, on_finish: Callable[[Job, str], None] | None = None):
        if max_queue < 1:
            raise ValueError(f"max_queue must be >= 1, got {max_queue}")
        self.pc, self.max_queue = pc, max_queue
        self.on_finish = on_finish or (lambda job, how: None)  # how: "done", "error", "cancelled"
        self._incoming: deque[Job] = deque()
        self._active: list[Job] = []
        self._in_flight = 0
        self._cv = threading.Condition()
        self._running = True
        self._thread = threading.Thread(target=self._run, name="promptcache-engine", daemon=True)
        self._thread.start()

    @property
    def in_flight(self) -> int:
        return self._in_flight

    def submit(self, start: Callable[[int], object], sampling: Sampling) -> Job:
        """Queue a request; call from the event loop. Raises QueueFull when at capacity."""
        job = Job(start, sampling, asyncio.get_running_loop(), asyncio.Queue())
        with self._cv:
            if self._in_flight >= self.max_queue:
                raise QueueFull(f"{self._in_flight} requests in flight, the queue holds {self.max_queue}")
            self._in_flight += 1
            self._incoming.append(job)
            self._cv.notify()
        return job

    def cancel(self, job: Job) -> None:
        """The client went away: the worker closes the job's stream and frees its cache."""
        with self._cv:
            job.cancelled = True
            self._cv.notify()

    def close(self, timeout: float = 10.0) -> None:
        with self._cv:
            self._running = False
            self._cv.notify()
        self._thread.join(timeout)

    # -- worker thread ---------------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            with self._cv:
                while self._running and not self._incoming and not self._active:
                    self._cv.wait()
                if not self._running:
                    break
                while self._incoming:
                    self._active.append(self._incoming.popleft())
            self._step_all()
        for job in self._active + list(self._incoming):
            self._finish(job, "cancelled")

    def _step_all(self) -> None:
        for job in list(self._active):
            if job.cancelled:
                self._finish(job, "cancelled")
                continue
            try:
                if job._it is None:
                    job._stream = self._open(job)
                    job._it = iter(job._stream)
                piece = next(job._it)
                job.emit("text", piece)
            except StopIteration:
                job.emit("done", job._stream.result)
                self._finish(job, "done")
            except Exception as e:  # noqa: BLE001 - reported to the client, the worker goes on
                log.exception("request failed")
                job.emit("error", e)
                self._finish(job, "error")

    def _open(self, job: Job):
        s = job.sampling

        def start(reserve: int):
            res = job.start(reserve)
            job.emit("prefilled", res)
            return res

        return self.pc.stream_from(start, max_new_tokens=s.max_new_tokens, temperature=s.temperature, top_p=s.top_p,
                                   stop=s.stop, seed=s.seed)

    def _finish(self, job: Job, how: str) -> None:
        if job._it is not None and how != "done":
            job._it.close()  # GeneratorExit inside the stream: its cache goes back to the pool
        job._it = job._stream = None
        if job in self._active:
            self._active.remove(job)
        with self._cv:
            self._in_flight -= 1
        if how == "cancelled":
            job.emit("error", asyncio.CancelledError())
        self.on_finish(job, how)
