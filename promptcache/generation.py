"""Decoding after a prefill: the token loop, text streaming, and the Generation result.

``start(reserve)`` is any callable returning a ``PrefillResult`` that holds its cache with room
for ``reserve`` more tokens: ``PromptCache.prefill(keep_cache=True)``, the baseline prefill, or
the RAG store's. The cache goes back to the engine's pool when decoding ends.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Iterator

import torch

from .cache import SpliceCache
from .sampling import TextStream, decode_loop, make_sampler

if TYPE_CHECKING:
    from .engine import PrefillResult, PromptCache


@dataclass
class Generation:
    text: str
    token_ids: list[int]
    ttft: float
    cached_tokens: int
    new_tokens: int
    exact: bool = False
    bytes_copied: int = 0
    hit_tiers: dict[str, int] = field(default_factory=dict)


class GenerationStream:
    """Iterate for text pieces as they are decoded; ``result`` is the finished Generation."""

    def __init__(self, pc: "PromptCache", start: Callable[[int], "PrefillResult"], max_new_tokens: int = 64,
                 temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0, stop: list[str] | None = None,
                 seed: int | None = None):
        self._pc, self._start, self._stop = pc, start, stop
        self._max = max_new_tokens
        self._sampler = make_sampler(temperature, top_p, top_k, seed)  # validates before any work
        self.result: Generation | None = None

    def __iter__(self) -> Iterator[str]:
        text, ids, state = TextStream(self._pc.tokenizer, self._stop), [], None
        for tok, state in self._tokens():
            ids.append(tok)
            piece = text.push(tok)
            if piece:
                yield piece
            if text.stopped:
                break
        else:
            tail = text.flush()
            if tail:
                yield tail
        if state is None:  # max_new_tokens < 1: statistics of the prefill alone
            state = self._start(0)
            self._pc.release(state)
        self.result = Generation(text.text, ids, state.ttft, state.cached_tokens, state.new_tokens, state.exact,
                                 state.bytes_copied, state.hit_tiers)

    def run(self) -> Generation:
        """Decode to the end without streaming."""
        for _ in self:
            pass
        return self.result

    def _tokens(self):
        if self._max < 1:
            return
        state = self._start(self._max)
        try:
            for tok in decode_loop(state.logits, _stepper(self._pc, state), self._sampler, self._max, self._pc._eos):
                yield tok, state
        finally:
            self._pc.release(state)


def _stepper(pc: "PromptCache", state: "PrefillResult") -> Callable[[int], torch.Tensor]:
    """One decoding step: run a token at the next position, return its logits [V]."""
    pos = state.next_position
    spliced = isinstance(state.cache, SpliceCache)

    def step(tok: int) -> torch.Tensor:
        nonlocal pos
        ids = torch.tensor([[tok]], dtype=torch.long, device=pc.device)
        with pc._lock:
            if spliced:
                p = torch.tensor([[pos]], dtype=torch.long, device=pc.device)
                pos += 1
                return pc.adapter.forward(ids, p, state.cache)[0]
            with torch.inference_mode():  # the baseline: stock positions, ordinary cache
                out = pc.model(input_ids=ids, past_key_values=state.cache, use_cache=True, logits_to_keep=1)
            return out.logits[0, -1]

    return step
