"""``Scheduler``: steps requests through prefill and decoding, one ``step()`` at a time.

    scheduler.add(request)
    while scheduler.has_work:
        for out in scheduler.step():   # StepOutput: request id, token id, text piece, finished, reason
            ...

One step is either the prefill of one waiting request (prefills first, as in vLLM: a new
request's first token comes early) or one decode step of every running request. Decode steps
are batched (``_decode_running``, continuous batching): while two or more requests run on
SpliceCaches, they join a ``DecodeBatch`` (``batch.py``) and each step is ONE forward for all of
them; a request alone decodes on its own cache (``ModelRunner.decode``, the hot path), as do
stock-cache requests and every request of a model whose adapter takes no custom mask (logged
once). A prefill blocks the decode steps of the others for its duration (chunked prefill would
interleave them; not done). A finished request's cache (or batch row) is released in the step
that finishes it. ``step()`` is not thread-safe: one thread drives one scheduler (the facade
gives each ``generate``/``stream`` call its own; the server runs one loop thread).

Errors: a failing step marks the requests it concerned (``Request.error``), releases what they
hold and re-raises; the other requests keep running.
"""

from __future__ import annotations

import logging

from ..cache import SpliceCache
from .batch import DecodeBatch, batch_refusal
from .request import Request, Status, StepOutput
from .runner import ModelRunner
from .serving import RequestQueue

log = logging.getLogger(__name__)

__all__ = ["Scheduler"]


class Scheduler(RequestQueue):
    def __init__(self, runner: ModelRunner):
        super().__init__()
        self.runner = runner
        self.batch = DecodeBatch(runner)
        self.batch_refusal = batch_refusal(runner)  # None: decode steps may share one forward
        self._refusal_logged = False

    def step(self) -> list[StepOutput]:
        """Cancel what was cancelled, then prefill one waiting request or decode the running ones."""
        outs = [self._finish(r, "cancelled") for r in [*self.waiting, *self.running] if r.cancel_requested]
        if self.waiting:
            outs.append(self._prefill(self.waiting.popleft()))
        elif self.running:
            outs += self._decode_running()
        return outs

    def _prefill(self, req: Request) -> StepOutput:
        try:
            req.begin(req.prompt.prefill(req.params.max_new_tokens))
            if req.params.max_new_tokens == 0:  # statistics of the prefill alone
                return self._finish(req, "length")
            self.running.append(req)
            return self._sample(req, req.prefill.logits)
        except BaseException as e:
            req.error = e
            self._drop(req)
            raise

    def _decode_running(self) -> list[StepOutput]:
        """One token for every running request: one forward for the batch, one each for the rest."""
        batched = [r for r in self.running if r in self.batch]
        joining = [r for r in self.running if r not in self.batch and isinstance(r.prefill.cache, SpliceCache)]
        if self.batch_refusal is not None:
            if joining and len(self.running) > 1 and not self._refusal_logged:
                log.info("decoding requests one forward each (no batched decode for this model): %s",
                         self.batch_refusal)
                self._refusal_logged = True
        elif joining and len(batched) + len(joining) >= 2:  # a request alone keeps its own cache
            self._guard(joining, lambda: self.batch.join(joining))
            batched += joining
        outs = []
        if batched:
            logits = self._guard(batched, self.batch.step)  # [B, V], rows in batch order
            self.decode_forwards += 1
            self.decode_tokens += len(batched)
            for row, req in enumerate(self.batch.rows):
                if req is not None:
                    req.position += 1
                    outs.append(self._guard([req], lambda: self._sample(req, logits[row])))
        for req in [r for r in self.running if r not in self.batch]:
            logits = self._guard([req], lambda: self.runner.decode(req.pending, req.position, req.prefill.cache))
            req.position += 1
            self.decode_forwards += 1
            self.decode_tokens += 1
            outs.append(self._guard([req], lambda: self._sample(req, logits)))
        return outs

    def _guard(self, reqs: list[Request], fn):
        """``fn()``; on an error, the requests it concerned are dropped (``error`` set) and it propagates."""
        try:
            return fn()
        except BaseException as e:
            for req in reqs:
                req.error = e
                self._drop(req)
            raise

    def _sample(self, req: Request, logits) -> StepOutput:
        token, piece, entry = req.sample_next(logits, self.runner.eos_ids)
        if req.finish_reason is not None:
            self._release(req)
        return req.emit(token, piece, entry)

    def _finish(self, req: Request, reason: str) -> StepOutput:
        req.finish_reason = reason
        if req.prefill is None:  # cancelled before its prefill: nothing was computed
            if req in self.waiting:
                self.waiting.remove(req)
            req.status = Status.FINISHED
        else:
            self._release(req)
        return req.emit(None, "")

    def _release(self, req: Request) -> None:
        if req in self.running:
            self.running.remove(req)
        if req in self.batch:
            self.batch.leave(req)
        if req.prefill is not None and req.prefill.cache is not None:
            self.runner.release(req.prefill.cache)
            req.prefill.cache = None
        req.status = Status.FINISHED

    def _drop(self, req: Request) -> None:
        """An error during the request's step: release what it holds, then let the error propagate."""
        req.finish_reason = req.finish_reason or "cancelled"
        self._release(req)
