"""``Request``: one generation as the engine steps it (waiting -> running -> finished).

A request is data: what it asks for (``prompt``: a ``PromptSpec``, ``prompts.py``), its sampling
settings, per-request logits processors and how many log-probabilities to record. The scheduler
asks the prompt for its ``PrefillPlan`` at admission (a prompt that recomputes part of its states
included: its recomputed tokens are rows of its prefill); nothing about the route is decided by
the caller. While it runs, the request also holds its serving state in one ``PoolState`` (``kv``):
the plan, the pool entries it reads, its own blocks and slots, the tokens whose states those
slots hold, and how many of its blocks it has shared. One object from submission to the end: the
scheduler keeps no other.

``paused``: the reader of its output stopped reading; the scheduler skips its decode steps until
it is cleared. ``outputs`` collects what each step produced for it (``StepOutput``), for whoever
reads it (a stream, the server's worker); the scheduler only appends.
"""

from __future__ import annotations

import enum
import itertools
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Sequence

import torch

from ..prefill.results import Generation, PrefillResult, TokenLogprob
from ..decoding.sampling import Sampler, SamplingParams
from ..decoding.text import TextStream

if TYPE_CHECKING:
    from ..prefill.plan import PrefillPlan, PromptSpec

__all__ = ["PoolState", "Request", "Status", "StepOutput"]

_ids = itertools.count()


class Status(enum.Enum):
    WAITING = "waiting"  # not prefilled yet
    RUNNING = "running"  # prefilled; ``pending`` is the last sampled token, not yet run
    FINISHED = "finished"


@dataclass(frozen=True, kw_only=True)
class StepOutput:
    request_id: int
    token_id: int | None  # None when the request finished without a new token (max_new_tokens=0, cancel)
    text: str  # new text ("" while held back: incomplete UTF-8 or a possible stop string)
    finished: bool
    finish_reason: str | None  # "stop" | "length" | "cancelled" once finished
    logprob: TokenLogprob | None = None  # the token's log-probability, when its request records them


@dataclass(eq=False, kw_only=True)
class PoolState:
    """A request's serving state in the KV pool, one object from admission to release: its plan,
    the pool entries and views it reads, its own blocks and slots, the tokens whose states those
    slots hold, and how many of its blocks it has shared."""

    plan: "PrefillPlan"
    entries: list  # pool entries it reads (released when it finishes)
    shared: list[tuple[str, torch.Tensor]]  # (cascade key, view [L, 2, H, n, D]) in KV order
    blocks: list[int]  # its own blocks, in token order (published ones included)
    slots: torch.Tensor  # [len(blocks) * block_size] pool slot of each own token
    bytes_copied: int = 0
    shared_pos: list[torch.Tensor] = field(default_factory=list)  # position IDs of each ``shared`` view
    shared_slots: list[torch.Tensor | None] = field(default_factory=list)  # pool slots of each view (None: not in the pool)
    shared_runs: list[tuple[int, int] | None] = field(default_factory=list)  # the same as runs (first, count) of ints
    shared_order: list[torch.Tensor] | None = None  # prompt index of each ``shared`` key (a plan in prompt order)
    shared_shift: list[int] | None = None  # positions each ``shared`` view's states lie behind where it is read
    own_ids: list[int] = field(default_factory=list)  # tokens whose states are in its own slots, in order
    own_pos: list[int] = field(default_factory=list)  # their positions
    published: int = 0  # leading own blocks shared under chain keys (no longer freed by it)
    publishing: bool = True  # False once a block's key was already shared by another request


class Request:
    def __init__(self, prompt: "PromptSpec", params: SamplingParams, tokenizer, constraints: Sequence = (),
                 logprobs: int | None = None):
        """``constraints``: per-request logits processors (``engine.decoding.constrained``). ``logprobs``:
        None records none; k records each token's log-probability and its k most likely rivals."""
        self.id = next(_ids)
        self.prompt, self.params = prompt, params
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
        self.outputs: deque[StepOutput] = deque()  # produced for it, not yet read
        self.submitted = 0.0  # perf_counter when it was submitted: its TTFT counts from there (queueing included)
        self.kv: PoolState | None = None  # its place in the KV pool, from admission (``scheduler.ServingScheduler``)

    @property
    def prefilling(self) -> bool:
        """Admitted and some of its plan's new tokens have not run yet."""
        return self.kv is not None and len(self.kv.own_ids) < len(self.kv.plan.new_ids)

    def admit(self, kv: "PoolState") -> None:
        """Record what the scheduler gave it at admission."""
        self.kv = kv

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

    def takes_argmax(self, argmax: int | None, eos: frozenset[int]) -> bool:
        """Whether this step's token is ``argmax`` (the logits' argmax, taken by the caller: a step
        takes all its rows' in one call) as it is: a plain greedy request's, unless an
        end-of-sequence token still masked (``mask_eos``; masking other tokens than the argmax
        leaves it the first argmax)."""
        return argmax is not None and self.sampler.plain_greedy and not (
            argmax in eos and len(self.token_ids) < self.params.min_tokens)

    def reads_logits(self, argmax: int | None, eos: frozenset[int]) -> bool:
        """Whether ``sample_next`` reads this step's logits: not where it takes ``argmax`` and records
        no log-probabilities (then the caller need not index its row of logits at all)."""
        return self.top_logprobs is not None or not self.takes_argmax(argmax, eos)

    def sample_next(self, logits: torch.Tensor | None, eos: frozenset[int],
                    argmax: int | None = None) -> tuple[int, str, TokenLogprob | None]:
        """One decoding step's token from ``logits`` [V], taken (``accept``): (token, new text, its
        log-probability entry or None). ``argmax``: the logits' argmax when the caller took it, the
        token where ``takes_argmax``; ``logits`` may be None where ``reads_logits`` is False."""
        takes = self.takes_argmax(argmax, eos)
        if logits is None and (self.top_logprobs is not None or not takes):  # ``reads_logits``
            raise ValueError(f"request {self.id}: sample_next needs this step's logits (it samples, masks an "
                             f"end-of-sequence token or records log-probabilities), got None")
        dist = self.distribution(logits)  # None unless the request records log-probabilities
        if takes:
            token = argmax
        else:
            token = self.sampler.sample(self.mask_eos(logits, eos), self.context)
        entry = self.record(token, dist)
        return token, self.accept(token, eos), entry

    def emit(self, token: int | None, text: str, logprob: TokenLogprob | None = None) -> StepOutput:
        """A step's output for this request, queued on ``outputs`` for its reader and returned."""
        out = StepOutput(request_id=self.id, token_id=token, text=text, finished=self.finished,
                         finish_reason=self.finish_reason, logprob=logprob)
        self.outputs.append(out)
        return out

    def generation(self) -> Generation:
        """The finished request as a Generation (text, ids, statistics of its prefill)."""
        assert self.finished and self.prefill is not None, (self.status, self.prefill)
        return Generation.from_prefill(self.prefill, self.text.text, self.token_ids, self.finish_reason,
                                       self.logprobs if self.top_logprobs is not None else None)
