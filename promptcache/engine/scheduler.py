"""``Scheduler``: steps requests through prefill and decoding, one ``step()`` at a time.

    scheduler.add(request)
    while scheduler.has_work:
        for out in scheduler.step():   # StepOutput: request id, token id, text piece, finished, reason
            ...

One step is either the prefill of one waiting request (prefills first, as in vLLM: a new
request's first token comes early) or one decode step of every running request. Today each
running request's decode step is its own forward (``ModelRunner.decode``); the design keeps the
running set apart from the forward so that a later change can run them as one batched forward
(``_decode_running`` is the one place to change). A finished request's cache is released in the
step that finishes it. ``step()`` is not thread-safe: one thread drives one scheduler (the facade
gives each ``generate``/``stream`` call its own; a server would run one loop thread).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from .request import Request, Status
from .runner import ModelRunner

__all__ = ["Scheduler", "StepOutput"]


@dataclass(frozen=True, kw_only=True)
class StepOutput:
    request_id: int
    token_id: int | None  # None when the request finished without a new token (max_new_tokens=0, cancel)
    text: str  # new text ("" while held back: incomplete UTF-8 or a possible stop string)
    finished: bool
    finish_reason: str | None  # "stop" | "length" | "cancelled" once finished


class Scheduler:
    def __init__(self, runner: ModelRunner):
        self.runner = runner
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, request: Request) -> None:
        if request.status is not Status.WAITING:
            raise ValueError(f"request {request.id} is {request.status.value}; only a new request can be added")
        self.waiting.append(request)

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
            req.begin(req.start(req.params.max_new_tokens))
            if req.params.max_new_tokens == 0:  # statistics of the prefill alone
                return self._finish(req, "length")
            self.running.append(req)
            return self._sample(req, req.prefill.logits)
        except BaseException:
            self._drop(req)
            raise

    def _decode_running(self) -> list[StepOutput]:
        """One token for every running request (today one forward each; batched later)."""
        outs = []
        for req in list(self.running):
            try:
                logits = self.runner.decode(req.pending, req.position, req.prefill.cache)  # [V]
                req.position += 1
                outs.append(self._sample(req, logits))
            except BaseException:
                self._drop(req)
                raise
        return outs

    def _sample(self, req: Request, logits) -> StepOutput:
        token = req.sampler.sample(logits, req.context)
        piece = req.accept(token, self.runner.eos_ids)
        if req.finish_reason is not None:
            self._release(req)
        return StepOutput(request_id=req.id, token_id=token, text=piece, finished=req.finished,
                          finish_reason=req.finish_reason)

    def _finish(self, req: Request, reason: str) -> StepOutput:
        req.finish_reason = reason
        if req.prefill is None:  # cancelled before its prefill: nothing was computed
            if req in self.waiting:
                self.waiting.remove(req)
            req.status = Status.FINISHED
        else:
            self._release(req)
        return StepOutput(request_id=req.id, token_id=None, text="", finished=True, finish_reason=reason)

    def _release(self, req: Request) -> None:
        if req in self.running:
            self.running.remove(req)
        if req.prefill is not None:
            self.runner.release(req.prefill.cache)
            req.prefill.cache = None
        req.status = Status.FINISHED

    def _drop(self, req: Request) -> None:
        """An error during the request's step: release what it holds, then let the error propagate."""
        req.finish_reason = req.finish_reason or "cancelled"
        self._release(req)
