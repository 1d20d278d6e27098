"""The seam between the HTTP layer and the engine: one worker thread steps the serving core.

The worker is a ``ComputeThread``: ``promptcache serve`` hands in the one that loaded the model,
so all parallel torch work of the process runs on one thread (``compute.py`` says why: a step
costs a third more otherwise on 2 cores).

It steps the engine's serving core (``engine.serving_core.core.Engine``, the one the library's ``generate``
runs on): every step is ONE forward that decodes a token for each running request and prefills
the next chunk of arriving prompts within a token budget, and shared states are read in place
from the KV pool.

Requests arrive as ``Job``s, each wrapping an engine ``Request`` (its prompt spec, sampling
settings, logits processors). Each step's outcome goes back to the request's asyncio loop as a
typed event (``events.py``: ``Prefilled``, ``Logprob``, ``Text``, then one of ``Done``,
``Failed``, ``Cancelled``); ``lifecycle.py`` reads them for every route.

Capacity: at most ``max_queue`` jobs are admitted at once (decoding or waiting); ``submit`` raises
``QueueFull`` beyond that (the server answers 503); the pool admits what fits, the rest waits.
``cancel`` (a client went away) stops the request at the next step, which frees its blocks,
whether it is queued, prefilling or decoding. Backpressure: a job whose reader leaves more than
``max_unread`` events unread is paused (no decode steps) until the reader catches up, and
cancelled after ``pause_timeout`` seconds paused. ``close(timeout)`` drains: running requests
go on for up to ``timeout`` seconds, then whatever is left is cancelled, and the pool's shared
blocks are handed down to the store (so a store that persists keeps them across a restart).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from concurrent import futures
from dataclasses import dataclass, field
from typing import Callable

from ...engine import Engine, PromptSpec, Request, SamplingParams, ServingConfig
from ...errors import PromptCacheError
from .compute import ComputeThread
from .events import Cancelled, Done, Event, Failed, Logprob, Prefilled, Text

log = logging.getLogger(__name__)


class QueueFull(PromptCacheError, RuntimeError):
    """More requests than ``max_queue`` are in flight."""

    exit_code = 2


@dataclass
class Job:
    request: Request  # the engine request, stepped by the worker
    loop: asyncio.AbstractEventLoop | None = None
    events: asyncio.Queue | None = None
    submitted: float = field(default_factory=time.perf_counter)
    reported: bool = False  # Prefilled was sent
    paused_since: float | None = None

    def emit(self, event: Event) -> None:
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, event)
        except RuntimeError:  # the request's event loop is gone (server shutting down)
            pass


class Backend:
    """Steps the engine on its compute thread; ``submit`` from the event loop, events back through ``job.events``."""

    def __init__(self, pc, max_queue: int = 64, on_finish: Callable[[Job, str], None] | None = None,
                 config: ServingConfig | None = None, compute: ComputeThread | None = None):
        """``compute``: the thread that runs the engine (``compute.py`` says why it should be the
        thread that loaded the model); None: a thread of its own."""
        if max_queue < 1:
            raise ValueError(f"max_queue must be >= 1, got {max_queue}")
        self.pc, self.max_queue, self.config = pc, max_queue, config or ServingConfig()
        self.compute = compute or ComputeThread()
        self.on_finish = on_finish or (lambda job, how: None)  # how: "done", "error", "cancelled"
        # built on the compute thread: it loads or compiles the native kernel and the compiled steps
        self.engine: Engine = self.compute.call(Engine, pc.core, self.config)
        self.pool, self.prefix = self.engine.pool, self.engine.prefix
        self.scheduler = self.engine.scheduler
        self._jobs: dict[int, Job] = {}  # request id -> job, submitted and not finished (added under _cv)
        self._in_flight = 0
        self._cv = threading.Condition()
        self._running = True
        self._done = self.compute.start(self._run)  # the worker loop, until close()

    @property
    def in_flight(self) -> int:
        return self._in_flight

    def submit(self, prompt: PromptSpec, params: SamplingParams, constraints: tuple = (),
               logprobs: int | None = None) -> Job:
        """Queue a request; call from the event loop. ``constraints``: fresh logits processors for
        this request; ``logprobs``: as ``Request``'s. Raises QueueFull when at capacity."""
        job = Job(Request(prompt, params, self.pc.tokenizer, constraints, logprobs), asyncio.get_running_loop(),
                  asyncio.Queue())
        with self._cv:
            if self._deadline is not None:
                raise QueueFull("the server is shutting down")
            if self._in_flight >= self.max_queue:
                raise QueueFull(f"{self._in_flight} requests in flight, the queue holds {self.max_queue}")
            self._in_flight += 1
            self._jobs[job.request.id] = job
            self.engine.submit(job.request)  # the one hand-off: the engine's incoming queue
            self._cv.notify()
        return job

    def cancel(self, job: Job) -> None:
        """The client went away: the scheduler stops the request at its next step and frees its cache."""
        with self._cv:
            job.request.cancel()
            self._cv.notify()

    def close(self, timeout: float = 10.0) -> None:
        """Drain: running and queued requests go on for up to ``timeout`` seconds, then the rest
        are cancelled and the worker stops."""
        with self._cv:
            self._deadline = time.monotonic() + timeout
            self._cv.notify()
        futures.wait([self._done], timeout + 5.0)
        with self._cv:
            self._running = False
            self._cv.notify()
        futures.wait([self._done], 5.0)
        if self._done.done():
            self.after_close(self.engine.close)  # shared blocks go down the store's tiers (persisted where the store persists)

    def after_close(self, fn: Callable[[], object]) -> None:
        """``fn()`` after ``close``: on the compute thread once the worker loop has ended, else (the
        drain timed out with a step still running) here: queued behind a loop that never ends, it
        would never run."""
        if self._done.done():
            self.compute.call(fn)
        else:
            fn()

    # -- worker thread ---------------------------------------------------------------------------
    _deadline: float | None = None  # set by close(): drain until then

    def _run(self) -> None:
        while True:
            with self._cv:
                while self._running and not self.engine.has_work:
                    if self._deadline is not None:
                        self._running = False
                        break
                    self._cv.wait()
                if not self._running or (self._deadline is not None and time.monotonic() > self._deadline):
                    break
            if self._backpressure():  # every running request is paused: nothing to step
                with self._cv:
                    self._cv.wait(0.05)
                continue
            self._step()
        for job in self._live():
            job.request.cancel()
        try:
            while self.engine.has_work:  # cancelled requests finish at once, freeing their caches
                self._step()
        finally:
            for job in self._live():
                self._finish(job, "cancelled")

    def _live(self) -> list[Job]:
        """The jobs submitted and not finished, a snapshot (``submit`` adds to them from the event loop)."""
        with self._cv:
            return list(self._jobs.values())

    def _backpressure(self) -> bool:
        """Pause jobs whose readers fell behind, cancel those paused too long; True when nothing
        but paused requests is left to step."""
        now, limit, active = time.monotonic(), self.config.max_unread, False
        jobs = self._live()
        for job in jobs:
            req = job.request
            req.paused = job.events.qsize() > limit
            if req.paused:
                job.paused_since = job.paused_since or now
                if now - job.paused_since > self.config.pause_timeout:
                    log.info("request %d: its reader left %d events unread for %.0f s; cancelled",
                             req.id, job.events.qsize(), now - job.paused_since)
                    req.cancel()
                    active = True
            else:
                job.paused_since = None
                active = active or not req.finished
        return bool(jobs) and not active and not self.scheduler.waiting and not self.engine.has_incoming

    def _step(self) -> None:
        try:
            outs = self.engine.step()
        except Exception:  # noqa: BLE001 - reported to the requests it concerned, the worker goes on
            log.exception("engine step failed")
            self._sweep()
            return
        for out in outs:
            job = self._jobs.get(out.request_id)
            if job is None:
                continue
            job.request.outputs.clear()  # read here, from the step's list
            if not job.reported and job.request.prefill is not None:
                job.reported = True
                job.emit(Prefilled(job.request.prefill))
            if out.logprob is not None:
                job.emit(Logprob(out.logprob))
            if out.text:
                job.emit(Text(out.text))
            if out.finished:
                self._report(job)

    def _sweep(self) -> None:
        """After a failed step: report every request that finished in it (failed or cancelled)."""
        for job in self._live():
            if job.request.finished:
                self._report(job)

    def _report(self, job: Job) -> None:
        """Count the request as finished (in-flight gauge, outcome counter), then tell its client:
        a client that reads /metrics after its answer sees its request counted."""
        req = job.request
        how = "error" if req.error is not None else "cancelled" if req.finish_reason == "cancelled" else "done"
        self._finish(job, how)
        if how == "error":
            job.emit(Failed(req.error))
        elif how == "done":
            job.emit(Done(req.generation()))

    @property
    def published_blocks(self) -> int:
        """Blocks requests shared in the pool."""
        return self.scheduler.published_blocks

    def stats(self) -> dict[str, int]:
        """The pool's block counts."""
        return self.pool.stats()

    def _finish(self, job: Job, how: str) -> None:
        with self._cv:
            self._jobs.pop(job.request.id, None)
            self._in_flight -= 1
        if how == "cancelled":
            job.emit(Cancelled())
        self.on_finish(job, how)
