"""``Engine``: the serving core in one object, driven in process by the library and by the server.

    engine = core.engine()                      # one per EngineCore (PromptCache.engine()), built on first use
    reqs = [Request(prompt, params, tokenizer) for prompt in specs]
    engine.run(reqs)                            # continuously batched until all have finished
    for out in engine.stream(req): ...          # or one request's StepOutputs as they come

It owns the KV pool (``kvpool.py``, sized by ``ServingConfig``), the step loop
(``serving.ServingScheduler``: one packed forward per step, chunked prefill, shared states read in
place), the prefix chains (``prefix.PrefixCache``: token prompts' blocks, published as requests
fill them) and, with ``RunnerConfig.compile``, the compiled steps; with ``RunnerConfig.cuda_graphs``,
decode steps over static buffers (CUDA graphs on a GPU: ``graphs.CapturedSteps``). ``PromptCache.generate`` /
``stream``, ``DocumentStore.generate``, ``promptcache chat`` and the server all submit requests
here, so a list of prompts given to ``generate`` is batched as concurrent HTTP requests are.

Threads. ``submit`` may be called from any thread (requests wait in an incoming queue); ``step``
runs under the engine's lock, so one thread steps at a time: in the library the calling threads
take turns (a thread stepping also advances the others' requests; each request's outputs wait
on ``Request.outputs`` for its reader), in the server the compute thread is the only one.
No thread is started here.

Every supported family runs on the pool (rotary, learned positions, ALiBi, sliding windows); a
model whose paged forward fails its self-check against the stock forward (``paged.paged_refusal``)
is refused here with the reason, never served another way.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from typing import Iterator

from ...models import UnsupportedModelError
from ...progress import Progress
from ..prefill.config import ServingConfig
from .graphs import CapturedSteps, CompiledSteps
from .kvpool import KVPool
from .paged import paged_refusal
from .prefix import PrefixCache
from .request import Request, StepOutput
from .scheduler import ServingScheduler

log = logging.getLogger(__name__)

__all__ = ["Engine"]


class Engine:
    def __init__(self, core, config: ServingConfig | None = None):
        """``core``: the ``EngineCore`` (``engine/core.py``) whose runner, store and planner requests
        use."""
        runner, store = core.runner, core.store
        self.config, self.store = config or ServingConfig(), store
        c = self.config
        self.prefix = PrefixCache(store, core.model_key, c.block_size)
        refusal = paged_refusal(runner)
        if refusal is not None:
            raise UnsupportedModelError(f"{type(runner.model).__name__} cannot run on the KV pool: {refusal}")
        pins = lambda key: store.pins is not None and store.pins.live(key)  # noqa: E731 - read per eviction
        self.pool = KVPool(runner.spec, runner.device, c.kv_pool_tokens, c.block_size, self.prefix.spill, pins)
        self.compiled: CompiledSteps | None = None
        if core.config.runner.compile:
            self.compiled = CompiledSteps(runner)
            self.compiled.warm()  # a first start compiles; later ones load from inductor's disk cache
        forward = self.compiled.forward if self.compiled else None
        self.captured: CapturedSteps | None = None
        if core.config.runner.cuda_graphs:  # decode steps over static buffers; the rest as above
            self.captured = CapturedSteps(runner, fallback=forward, compile=core.config.runner.compile)
            forward = self.captured.forward
        self.scheduler = ServingScheduler(runner, self.pool, c.max_num_batched_tokens, c.max_num_seqs,
                                          on_publish=_write_through(store), forward=forward,
                                          planner=core.planner, chains=self.prefix)
        self.lock = threading.RLock()  # held while a step runs: one thread steps at a time
        self._incoming: deque[Request] = deque()  # appended from any thread, drained by the stepping one
        self._live: list[Request] = []  # submitted, not seen finished (stepping thread)

    @property
    def has_incoming(self) -> bool:
        """Requests submitted and not yet handed to the scheduler."""
        return bool(self._incoming)

    @property
    def has_work(self) -> bool:
        return bool(self._incoming) or self.scheduler.has_work

    def matched_tokens(self, ids: list[int], namespace: str) -> int:
        """Leading tokens of the token prompt ``ids`` whose blocks the pool or the store holds (what
        a ``TokenPrompt`` of them would reuse; at least one token is always left to run)."""
        n = 0
        for key in self.prefix.keys(ids[: max(len(ids) - 1, 0)], namespace):
            if key not in self.pool and key not in self.store:
                break
            n += 1
        return n * self.prefix.block_size

    def submit(self, request: Request) -> Request:
        """Queue a request (any thread); it is admitted by a later step. Its TTFT counts from now."""
        request.submitted = time.perf_counter()
        self._incoming.append(request)
        return request

    def step(self) -> list[StepOutput]:
        """Admit what was submitted, then one step of the scheduler; each output is also queued
        on its request's ``outputs``."""
        with self.lock:
            while self._incoming:
                req = self._incoming.popleft()
                self._live.append(req)
                self.scheduler.add(req)
            try:
                return self.scheduler.step()
            finally:
                self._live = [r for r in self._live if not r.finished]

    def run(self, requests: list[Request], progress: Progress | None = None) -> list[Request]:
        """Submit ``requests`` and step until every one has finished (others submitted meanwhile are
        stepped too). ``progress(done, total)`` once at 0 and after each step that finished some,
        the last call (done == total) closing a bar. A step that fails marks the requests it
        concerned (``Request.error``) and the loop goes on."""
        for r in requests:
            self.submit(r)
        total, done = len(requests), 0
        if progress is not None:
            progress(0, total)
        while done < total:
            self._step_guarded()
            finished = sum(r.finished for r in requests)  # counted after the step: the last one is reported
            if progress is not None and finished != done:
                progress(finished, total)
            done = finished
        return requests

    def stream(self, request: Request) -> Iterator[StepOutput]:
        """Submit ``request`` and yield its outputs as steps produce them. Leaving the loop early
        (``break``, an exception, garbage collection) cancels it and frees its blocks at once."""
        self.submit(request)
        try:
            while True:
                while request.outputs:
                    out = request.outputs.popleft()
                    yield out
                    if out.finished:
                        return
                if request.finished and not request.outputs:
                    return
                self._step_guarded()
        finally:
            if not request.finished:
                request.cancel()
                while not request.finished and self.has_work:
                    self._step_guarded()

    def _step_guarded(self) -> None:
        """A step; a failure that the step reported to the requests it concerned (``Request.error``)
        is logged and the others go on; any other failure propagates."""
        live = list(self._live) + list(self._incoming)
        try:
            self.step()
        except Exception as e:
            if not any(r.error is e for r in live):
                raise
            log.exception("engine step failed")

    def close(self) -> None:
        """Hand the pool's idle shared blocks down the store's tiers (persisted where it persists)."""
        with self.lock:
            self.pool.clear_idle()


def _write_through(store):
    """``on_publish`` for a store whose tiers take every new state (shared write-through tiers, a
    disk tier ``through`` or ``behind``): each block a request publishes is written there too, so
    other replicas find it and a killed process finds it after a restart (None: no such tier)."""
    tiers = [t for t in store.shared if t.write_policy == "through"]
    if not tiers and not store.keeps_new:
        return None

    def publish(key, kv):
        data = kv.clone()
        for tier in tiers:
            tier.put(key, data)
        if store.keeps_new:
            store.keep(key, data)

    return publish
