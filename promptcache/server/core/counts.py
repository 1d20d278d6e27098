"""What "cached" means, once, for every report of a request: ``TokenCounts``.

A prompt's tokens are of three kinds, and ``prompt = cached + recomputed + new``:

- ``cached``: served from stored states (KV read as it was stored, not computed for this request);
- ``recomputed``: laid out from stored states but computed afresh in this prompt's context
  (selective recompute of reused documents or drifted modules): they cost a forward like new ones;
- ``new``: run through the model because nothing was stored for them (free text, arguments).

The API's usage (``prompt_tokens_details.cached_tokens``, ``recomputed_tokens``; Anthropic's
``cache_read_input_tokens``), the access log (``cached= recomputed= new=``), ``/metrics``
(``promptcache_cached_tokens``, ``promptcache_recomputed_tokens``, ``promptcache_new_tokens``) and
the studio's hit rate (cached / prompt) all read these numbers. (The engine's ``Generation`` and
``PrefillResult`` keep their own field names: their ``cached_tokens`` is cached + recomputed here.)
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["TokenCounts"]


@dataclass(frozen=True)
class TokenCounts:
    cached: int  # served from stored states
    recomputed: int  # laid out from stored states, computed afresh
    new: int  # run through the model, nothing stored for them

    @property
    def prompt(self) -> int:
        return self.cached + self.recomputed + self.new

    @classmethod
    def of(cls, result) -> "TokenCounts":
        """From a ``PrefillResult`` or a ``Generation`` (``cached_tokens`` there counts the recomputed too)."""
        assert 0 <= result.recomputed_tokens <= result.cached_tokens, result
        return cls(cached=result.cached_tokens - result.recomputed_tokens, recomputed=result.recomputed_tokens,
                   new=result.new_tokens)

    def fields(self) -> dict[str, int]:
        """For the access log: prompt, cached, recomputed, new."""
        return {"prompt": self.prompt, "cached": self.cached, "recomputed": self.recomputed, "new": self.new}
