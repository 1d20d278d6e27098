"""The seam between the HTTP layer and the engine: one worker thread steps one shared ``Scheduler``.

Requests arrive as ``Job``s (a ``start(reserve) -> PrefillResult`` callable and sampling
settings), each wrapping an engine ``Request``. The worker adds arriving requests to the
scheduler and calls ``step()`` while there is work: a step is the prefill of one waiting request
or ONE batched decode forward of every running one (continuous batching, see
``promptcache/engine/batch.py``), so no request waits for another's whole generation. A prefill
holds up the others' decoding for its duration (chunked prefill would fix that; not done).
Each step's outcome goes back to the request's asyncio loop as an event:

    ("prefilled", PrefillResult)  after the prompt ran (usage, TTFT)
    ("logprob", TokenLogprob)     a token's log-probability (requests that ask), before its text
    ("text", str)                 a decoded text piece
    ("done", Generation)          finished; the cache (or batch row) is free again
    ("error", Exception)          failed; nothing more follows

Capacity: at most ``max_queue`` jobs are admitted at once (decoding or waiting for their
prefill); ``submit`` raises ``QueueFull`` beyond that (the server answers 503). ``cancel``
(a client went away) asks the scheduler to stop the request at its next step, which frees its
cache or batch row. A step that fails marks the requests it concerned (``Request.error``): those
get an error event, the others go on.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

from ..engine import Request, SamplingParams, Scheduler
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
    constraints: tuple = ()  # per-request logits processors (JSON output); fresh ones per job
    logprobs: int | None = None  # None: none; k: each token's log-probability and k rivals

    def params(self) -> SamplingParams:
        return SamplingParams(max_new_tokens=self.max_new_tokens, temperature=self.temperature, top_p=self.top_p,
                              stop=tuple(self.stop or ()), seed=self.seed)


@dataclass
class Job:
    start: Callable[[int], object]  # start(reserve) -> PrefillResult holding its cache
    sampling: Sampling
    loop: asyncio.AbstractEventLoop | None = None
    events: asyncio.Queue | None = None
    request: Request | None = None  # the engine request, stepped by the worker's scheduler
    cancelled: bool = False
    submitted: float = field(default_factory=time.perf_counter)

    def emit(self, kind: str, value) -> None:
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, (kind, value))
        except RuntimeError:  # the request's event loop is gone (server shutting down)
            pass


class Backend:
    """Owns the engine's scheduler; ``submit`` from the event loop, events back through ``job.events``."""

    def __init__(self, pc, max_queue: int = 64, on_finish: Callable[[Job, str], None] | None = None):
        if max_queue < 1:
            raise ValueError(f"max_queue must be >= 1, got {max_queue}")
        self.pc, self.max_queue = pc, max_queue
        self.on_finish = on_finish or (lambda job, how: None)  # how: "done", "error", "cancelled"
        self.scheduler = Scheduler(pc.runner)  # stepped by the worker thread only
        self._incoming: deque[Job] = deque()
        self._jobs: dict[int, Job] = {}  # request id -> job, admitted and not finished (worker thread)
        self._in_flight = 0
        self._cv = threading.Condition()
        self._running = True
        self._thread = threading.Thread(target=self._run, name="promptcache-engine", daemon=True)
        self._thread.start()

    @property
    def in_flight(self) -> int:
        return self._in_flight

    def submit(self, start: Callable[[int], object], sampling: Sampling) -> Job:
        """Queue a request; call from the event loop. Raises QueueFull when at capacity, ValueError
        for sampling settings the engine refuses."""
        job = Job(start, sampling, asyncio.get_running_loop(), asyncio.Queue())

        def start_and_report(reserve: int):
            res = job.start(reserve)
            job.emit("prefilled", res)
            return res

        job.request = Request(start_and_report, sampling.params(), self.pc.tokenizer, sampling.constraints,
                              sampling.logprobs)
        with self._cv:
            if self._in_flight >= self.max_queue:
                raise QueueFull(f"{self._in_flight} requests in flight, the queue holds {self.max_queue}")
            self._in_flight += 1
            self._incoming.append(job)
            self._cv.notify()
        return job

    def cancel(self, job: Job) -> None:
        """The client went away: the scheduler stops the request at its next step and frees its cache."""
        with self._cv:
            job.cancelled = True
            job.request.cancel()
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
                while self._running and not self._incoming and not self.scheduler.has_work:
                    self._cv.wait()
                if not self._running:
                    break
                while self._incoming:
                    job = self._incoming.popleft()
                    self._jobs[job.request.id] = job
                    self.scheduler.add(job.request)
            self._step()
        with self._cv:
            while self._incoming:
                job = self._incoming.popleft()
                self._jobs[job.request.id] = job
                self.scheduler.add(job.request)
        for job in self._jobs.values():
            job.request.cancel()
        try:
            while self.scheduler.has_work:  # cancelled requests finish at once, freeing their caches
                self._step()
        finally:
            for job in list(self._jobs.values()):
                self._finish(job, "cancelled")

    def _step(self) -> None:
        try:
            outs = self.scheduler.step()
        except Exception:  # noqa: BLE001 - reported to the requests it concerned, the worker goes on
            log.exception("engine step failed")
            self._sweep()
            return
        for out in outs:
            job = self._jobs.get(out.request_id)
            if job is None:
                continue
            if out.logprob is not None:
                job.emit("logprob", out.logprob)
            if out.text:
                job.emit("text", out.text)
            if out.finished:
                self._report(job)

    def _sweep(self) -> None:
        """After a failed step: report every request that finished in it (failed or cancelled)."""
        for job in list(self._jobs.values()):
            if job.request.finished:
                self._report(job)

    def _report(self, job: Job) -> None:
        req = job.request
        if req.error is not None:
            job.emit("error", req.error)
            self._finish(job, "error")
        elif req.finish_reason == "cancelled":
            self._finish(job, "cancelled")
        else:
            job.emit("done", req.generation())
            self._finish(job, "done")

    def _finish(self, job: Job, how: str) -> None:
        self._jobs.pop(job.request.id, None)
        with self._cv:
            self._in_flight -= 1
        if how == "cancelled":
            job.emit("error", asyncio.CancelledError())
        self.on_finish(job, how)
