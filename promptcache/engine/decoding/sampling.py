"""``SamplingParams`` (one validated dataclass) and ``Sampler``, built on transformers' logits processors.

The processors are the ones ``model.generate`` builds, in its order: repetition penalty over
the context (prompt tokens in prompt order, then the generated ones), then, when sampling,
temperature, top-k, top-p. So greedy decoding with ``repetition_penalty`` gives the tokens
``model.generate(do_sample=False, repetition_penalty=...)`` gives, and a sampled step draws from
the distribution ``model.generate(do_sample=True, ...)`` draws from (the random draws differ:
ours come from a per-request ``torch.Generator`` seeded by ``seed``).

Decisions:
  * ``temperature == 0`` is greedy (argmax after the penalty); the warpers are then not applied,
    as in ``generate(do_sample=False)``.
  * ``top_k == 0`` and ``top_p == 1`` disable those warpers; ``repetition_penalty == 1`` disables
    the penalty, and the context is then never materialized (the greedy path is one argmax).
  * Sampling runs on CPU in float32 with the request's generator, so a seed gives the same tokens
    on every device.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Sequence

import torch
from transformers import GenerationConfig
from transformers.generation.logits_process import (LogitsProcessorList, RepetitionPenaltyLogitsProcessor,
                                                    TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper)

from ...errors import ConfigError

__all__ = ["Sampler", "SamplingParams", "sampling_params"]


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens and when to stop. ``stop``: strings that end the text (not included)."""

    max_new_tokens: int = 64
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0  # (0, 1]
    top_k: int = 0  # 0: off
    repetition_penalty: float = 1.0  # > 0; 1: off (transformers' definition: divides positive logits)
    stop: tuple[str, ...] = ()
    seed: int | None = None  # None: a fresh random seed per request
    min_tokens: int = 0  # end-of-sequence tokens are masked until this many were generated (vLLM's field)
    ignore_eos: bool = False  # an end-of-sequence token does not end generation (vLLM's field; benchmarks)

    def __post_init__(self):
        stop = () if self.stop is None else (self.stop,) if isinstance(self.stop, str) else self.stop
        _check(self, "stop", isinstance(stop, (list, tuple)) and all(isinstance(s, str) for s in stop),
               "a string or a list of strings")
        object.__setattr__(self, "stop", tuple(stop))
        _check(self, "max_new_tokens", _is_int(self.max_new_tokens) and self.max_new_tokens >= 0, "an integer >= 0")
        _check(self, "temperature", _is_real(self.temperature) and self.temperature >= 0, "a finite number >= 0")
        _check(self, "top_p", _is_real(self.top_p) and 0 < self.top_p <= 1, "a number in (0, 1]")
        _check(self, "top_k", _is_int(self.top_k) and self.top_k >= 0, "an integer >= 0")
        _check(self, "repetition_penalty", _is_real(self.repetition_penalty) and self.repetition_penalty > 0,
               "a finite number > 0")
        _check(self, "min_tokens", _is_int(self.min_tokens) and self.min_tokens >= 0, "an integer >= 0")
        _check(self, "ignore_eos", isinstance(self.ignore_eos, bool), "true or false")
        _check(self, "seed", self.seed is None or (_is_int(self.seed) and -(2**63) <= self.seed < 2**64),
               "None or an integer in [-2**63, 2**64) (what a torch.Generator takes)")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def generation_config(self) -> GenerationConfig:
        """The same settings as a transformers ``GenerationConfig`` (for ``model.generate``)."""
        return GenerationConfig(max_new_tokens=self.max_new_tokens, do_sample=not self.greedy,
                                temperature=self.temperature if not self.greedy else None,
                                top_k=self.top_k if not self.greedy else None,
                                top_p=self.top_p if not self.greedy else None,
                                repetition_penalty=self.repetition_penalty)

    def processors(self) -> LogitsProcessorList:
        """transformers' processors for these settings, in ``model.generate``'s order."""
        out = LogitsProcessorList()
        if self.repetition_penalty != 1.0:
            out.append(RepetitionPenaltyLogitsProcessor(self.repetition_penalty))
        if not self.greedy:
            if self.temperature != 1.0:
                out.append(TemperatureLogitsWarper(self.temperature))
            if self.top_k:
                out.append(TopKLogitsWarper(top_k=self.top_k))
            if self.top_p < 1.0:
                out.append(TopPLogitsWarper(top_p=self.top_p))
        return out


def sampling_params(params: SamplingParams | int | None = None, **kwargs) -> SamplingParams:
    """``params`` with ``kwargs`` applied (the facade's ``generate(prompt, params, **kwargs)``).
    An int for ``params`` is ``max_new_tokens`` (callers written before SamplingParams passed it
    positionally). Unknown names are a TypeError that lists the known ones."""
    if _is_int(params):
        kwargs = {"max_new_tokens": params, **kwargs}
        params = None
    if params is not None and not isinstance(params, SamplingParams):
        raise TypeError(f"params must be a SamplingParams, got {type(params).__name__}")
    known = [f.name for f in fields(SamplingParams)]
    unknown = sorted(set(kwargs) - set(known))
    if unknown:
        raise TypeError(f"unknown sampling setting(s) {', '.join(unknown)} (known: {', '.join(known)})")
    base = params or SamplingParams()
    return SamplingParams(**{**{k: getattr(base, k) for k in known}, **kwargs}) if kwargs else base


class Sampler:
    """Picks one request's tokens: ``sample(logits [V], context)`` -> token id.

    ``constraints``: per-request logits processors (``engine.decoding.constrained``) run before the
    settings' own; they read the context (its last id is the previous sampled token), so a
    sampler with constraints always keeps one and never takes the plain argmax shortcut."""

    def __init__(self, params: SamplingParams, constraints: Sequence = ()):
        self.params = params
        self.processors = LogitsProcessorList([*constraints, *params.processors()])
        self.needs_context = params.repetition_penalty != 1.0 or bool(constraints)
        # whether ``sample`` is the logits' argmax (greedy, nothing reads the context): read for every
        # decode row of every step, so worked out once
        self.plain_greedy = params.greedy and not self.needs_context
        self.generator = None
        if not params.greedy:
            self.generator = torch.Generator()
            self.generator.manual_seed(params.seed) if params.seed is not None else self.generator.seed()

    def scores(self, logits: torch.Tensor, context: Sequence[int] = ()) -> torch.Tensor:
        """Processed scores [1, V] (float32, -inf where a warper removed a token). ``context``:
        prompt then generated token ids (read only when ``needs_context``)."""
        x = logits.detach().float().reshape(1, -1)
        if not self.processors:
            return x
        ids = torch.tensor([list(context)], dtype=torch.long, device=x.device) if self.needs_context else None
        if ids is None:
            ids = torch.zeros((1, 0), dtype=torch.long, device=x.device)
        return self.processors(ids, x)

    def sample(self, logits: torch.Tensor, context: Sequence[int] = ()) -> int:
        if self.plain_greedy:
            return int(torch.argmax(logits))
        x = self.scores(logits, context)
        if self.params.greedy:
            return int(torch.argmax(x))
        probs = torch.softmax(x[0].cpu(), -1)
        return int(torch.multinomial(probs, 1, generator=self.generator))


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_real(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _check(params: SamplingParams, name: str, ok: bool, expected: str) -> None:
    if not ok:
        raise ConfigError(f"SamplingParams.{name} must be {expected}, got {getattr(params, name)!r}")
