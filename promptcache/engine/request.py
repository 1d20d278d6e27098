"""``Request``: one generation's state as the scheduler steps it (waiting -> running -> finished).

A request is data: sampling settings and one way to its prefill. Either ``start(reserve)``, any
callable returning a ``PrefillResult`` that holds its cache with room for ``reserve`` more tokens
(``PromptCache.prefill(keep_cache=True)``, the baseline prefill, the RAG store's): the cache
belongs to the request from its prefill until it finishes, and the scheduler gives it back then,
however it finishes (stop, length, cancel, error). Or ``plan(pool) -> PrefillPlan`` (``plan.py``),
which only ``ServingScheduler`` runs: the states it names are read in place from the KV pool; a
plan that returns None (the prompt must recompute part of its states) falls back to ``start``.
``paused``: the reader of its output stopped reading; the serving scheduler skips its decode
steps until it is cleared.
"""

from __future__ import annotations

import enum
import itertools
from typing import Callable, Sequence

import torch

from .results import Generation, PrefillResult, TokenLogprob
from .sampling import Sampler, SamplingParams
from .text import TextStream

__all__ = ["Request", "Status"]

_ids = itertools.count()


class Status(enum.Enum):
    WAITING = "waiting"  # not prefilled yet
    RUNNING = "running"  # prefilled; ``pending`` is the last sampled token, not yet run
    FINISHED = "finished"


class Request:
    def __init__(self, start: Callable[[int], PrefillResult] | None, params: SamplingParams, tokenizer,
                 constraints: Sequence = (), logprobs: int | None = None, *,
                 plan: Callable[[object], object] | None = None):
        """``constraints``: per-request logits processors (``engine.constrained``). ``logprobs``:
        None records none; k records each token's log-probability and its k most likely rivals."""
        if start is None and plan is None:
            raise ValueError("a request needs a start (a prefill callable), a plan, or both")
        self.id = next(_ids)
        self.start, self.plan, self.params = start, plan, params
        self.sampler = Sampler(params, constraints)
        self.top_logprobs = logprobs
        self.logprobs: list[TokenLogprob] = []
        self.text = TextStream(tokenizer, params.stop)
        self.status = Status.WAITING
        self.prefill: PrefillResult | None = None
        self.token_ids: list[int] = []  # generated so far
        self.context: list[int] = []  # prompt ids in prompt order, then generated (read by the penalty)
        self.pending: int | None = None  # sampled, not yet run through the model
        self.position = 0  # position ID of ``pending``
        self.finish_reason: str | None = None
        self.cancel_requested = False
        self.paused = False
        self.error: BaseException | None = None  # set when a step failed for this request (it is finished then)

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED

    def cancel(self) -> None:
        """Ask the scheduler to stop this request at its next step (its cache is released then)."""
        self.cancel_requested = True

    def begin(self, prefill: PrefillResult) -> None:
        """Record the prefill: the request is running, generation continues at its next position."""
        self.prefill, self.status = prefill, Status.RUNNING
        self.position = prefill.next_position
        if self.sampler.needs_context and prefill.layout is not None:
            self.context = list(prefill.layout.token_ids)

    def distribution(self, logits: torch.Tensor) -> torch.Tensor | None:
        """log_softmax of the raw logits [V] when log-probabilities are recorded (else None); taken
        before sampling, which may edit the logits in place (a repetition penalty does)."""
        if self.top_logprobs is None:
            return None
        return torch.log_softmax(logits.detach().float().reshape(-1), -1).cpu()

    def record(self, token: int, dist: torch.Tensor | None) -> TokenLogprob | None:
        """The sampled token's entry (appended to ``logprobs``), or None when none are recorded."""
        if dist is None:
            return None
        vals, ids = torch.topk(dist, self.top_logprobs) if self.top_logprobs else (dist[:0], dist[:0])
        entry = TokenLogprob(token, float(dist[token]), tuple(zip(map(int, ids.tolist()), vals.tolist())))
        self.logprobs.append(entry)
        return entry

    def mask_eos(self, logits: torch.Tensor, eos: frozenset[int]) -> torch.Tensor:
        """``logits`` [V] with end-of-sequence tokens masked while fewer than ``min_tokens`` were
        generated (called after ``distribution``, so log-probabilities stay raw)."""
        if eos and len(self.token_ids) < self.params.min_tokens:
            logits = logits.clone()  # the prefill's logits are reported as they came
            logits[list(eos)] = float("-inf")
        return logits

    def accept(self, token: int, eos: frozenset[int]) -> str:
        """Take a sampled token: returns the new text; finishes the request on EOS, a stop string
        or ``max_new_tokens``."""
        self.token_ids.append(token)
        if self.sampler.needs_context:
            self.context.append(token)
        piece = self.text.push(token)
        if self.text.stopped or (token in eos and not self.params.ignore_eos):
            self.finish_reason = "stop"
        elif len(self.token_ids) >= self.params.max_new_tokens:
            self.finish_reason = "length"
        if self.finish_reason is not None and not self.text.stopped:
            piece += self.text.flush()
        self.pending = token if self.finish_reason is None else None
        return piece

    def sample_next(self, logits: torch.Tensor, eos: frozenset[int]) -> tuple[int, str, TokenLogprob | None]:
        """One decoding step's token from ``logits`` [V], taken (``accept``): (token, new text, its
        log-probability entry or None). Both schedulers sample through here."""
        dist = self.distribution(logits)  # None unless the request records log-probabilities
        token = self.sampler.sample(self.mask_eos(logits, eos), self.context)
        entry = self.record(token, dist)
        return token, self.accept(token, eos), entry

    def generation(self) -> Generation:
        """The finished request as a Generation (text, ids, statistics of its prefill)."""
        assert self.finished and self.prefill is not None, (self.status, self.prefill)
        return Generation.from_prefill(self.prefill, self.text.text, self.token_ids, self.finish_reason,
                                       self.logprobs if self.top_logprobs is not None else None)
