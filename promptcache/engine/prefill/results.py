"""Results, built by keyword and complete at construction: ``PrefillResult``, ``Generation``, ``Usage``.

``PrefillResult`` is what a prefill hands to decoding (logits and, with ``keep_cache``, the
cache); ``Generation`` is what ``generate`` returns. Both say whether the answer is exact (the
state equals a plain prefill's) or approximate, and how many cached tokens were recomputed:
``cached_tokens`` counts the prompt tokens laid out from stored states, ``recomputed_tokens`` those
of them computed afresh, and ``reused_tokens`` (= ``Usage.cached_tokens``) the ones actually
served from stored states. Neither is patched after construction;
the one exception is ``PrefillResult.cache``, which ``PromptCache.release`` clears so a buffer
is never handed back to the pool twice.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from ...layout import PromptLayout

__all__ = ["FINISH_REASONS", "Generation", "PrefillResult", "TokenLogprob", "Usage", "preview"]

# "stop": an EOS token or a stop string; "length": max_new_tokens reached;
# "cancelled": Request.cancel() (a stream left early, a server client gone).
FINISH_REASONS = ("stop", "length", "cancelled")
PREVIEW_CHARS = 60  # reprs show at most this much of a text


def preview(text: str, limit: int = PREVIEW_CHARS) -> str:
    """``repr`` of ``text`` cut to ``limit`` characters, with the full length when cut."""
    if len(text) <= limit:
        return repr(text)
    return f"{text[:limit]!r}... ({len(text)} chars)"


@dataclass(kw_only=True)
class PrefillResult:
    logits: torch.Tensor  # [vocab], next-token logits after the prompt
    ttft: float  # seconds: prompt in, logits out
    cached_tokens: int  # entries served from stored states
    new_tokens: int  # tokens run through the model (cached_tokens + new_tokens = prompt tokens)
    exact: bool  # the state equals a plain prefill of the same tokens
    bytes_copied: int = 0  # stored KV bytes copied to assemble this prompt (0: all already in place)
    hit_tiers: dict[str, int] = field(default_factory=dict)  # cached spans served per tier
    layout: PromptLayout | None = None
    cache: object = field(default=None, repr=False)  # kept only with keep_cache=True (SpliceCache or a stock Cache)
    next_position: int = 0  # position ID of the first generated token
    recomputed_tokens: int = 0  # cached tokens whose states were computed afresh (selective recompute)

    @property
    def prompt_tokens(self) -> int:
        return self.cached_tokens + self.new_tokens

    @property
    def reused_tokens(self) -> int:
        """Prompt tokens served from stored states (cached and not recomputed)."""
        return self.cached_tokens - self.recomputed_tokens

    def __repr__(self) -> str:  # counts only: the logits and layout run to tens of thousands of characters
        return (f"PrefillResult(cached_tokens={self.cached_tokens}, new_tokens={self.new_tokens}, "
                f"recomputed_tokens={self.recomputed_tokens}, "
                f"ttft={self.ttft * 1e3:.1f}ms, exact={self.exact}, bytes_copied={self.bytes_copied}, "
                f"hit_tiers={self.hit_tiers}, logits={tuple(self.logits.shape)}, "
                f"cache={'kept' if self.cache is not None else None})")


@dataclass(frozen=True)
class TokenLogprob:
    """One generated token's log-probability under the model (log_softmax of the raw logits, before
    any sampling setting or constraint) and the ``top`` most likely ids, most likely first."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True)
class Usage:
    """Token counts in OpenAI's terms; ``cached_tokens`` of ``prompt_tokens`` came from stored states."""

    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0
    total_tokens: int = field(init=False)

    def __post_init__(self):
        object.__setattr__(self, "total_tokens", self.prompt_tokens + self.completion_tokens)


@dataclass(kw_only=True)
class Generation:
    text: str
    token_ids: list[int]  # generated ids, an EOS or stop-string token included
    ttft: float
    cached_tokens: int
    new_tokens: int
    exact: bool = False
    bytes_copied: int = 0
    hit_tiers: dict[str, int] = field(default_factory=dict)
    finish_reason: str = "length"  # one of FINISH_REASONS
    usage: Usage | None = None
    recomputed_tokens: int = 0  # of cached_tokens, computed afresh (selective recompute)
    logprobs: list[TokenLogprob] | None = None  # one per generated token, when asked for

    def __post_init__(self):
        if self.finish_reason not in FINISH_REASONS:
            raise ValueError(f"Generation.finish_reason must be one of {FINISH_REASONS}, got {self.finish_reason!r}")
        if self.usage is None:
            self.usage = Usage(self.cached_tokens + self.new_tokens, len(self.token_ids), self.reused_tokens)

    @property
    def reused_tokens(self) -> int:
        """Prompt tokens served from stored states (cached and not recomputed)."""
        return self.cached_tokens - self.recomputed_tokens

    def __repr__(self) -> str:  # a short preview of the text and counts, never the whole output
        return (f"Generation(text={preview(self.text)}, tokens={len(self.token_ids)}, "
                f"finish_reason={self.finish_reason!r}, ttft={self.ttft * 1e3:.1f}ms, "
                f"cached_tokens={self.cached_tokens}, new_tokens={self.new_tokens}, "
                f"recomputed_tokens={self.recomputed_tokens}, exact={self.exact})")

    @classmethod
    def from_prefill(cls, prefill: PrefillResult, text: str, token_ids: list[int], finish_reason: str,
                     logprobs: list[TokenLogprob] | None = None) -> "Generation":
        return cls(text=text, token_ids=list(token_ids), ttft=prefill.ttft, cached_tokens=prefill.cached_tokens,
                   new_tokens=prefill.new_tokens, exact=prefill.exact, bytes_copied=prefill.bytes_copied,
                   hit_tiers=dict(prefill.hit_tiers), finish_reason=finish_reason,
                   recomputed_tokens=prefill.recomputed_tokens, logprobs=logprobs)
