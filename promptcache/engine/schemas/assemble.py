"""Plan a prompt's prefill: which stored states go where (store lookups), which tokens run.

Decisions:
  * KV order is the cached spans in prompt order, then the new tokens (arguments, free text,
    ``cache="false"`` modules, chat glue) at their position IDs.
  * A prompt with no new tokens recomputes its last cached token as a new token (its stored entry
    is left out), so next-token logits reflect exactly what the prompt imports.
  * ``leading_exact``: the leading cached tokens (prompt order) whose stored states are those of a
    plain prefill (each span encoded after exactly the spans before it, positions 0..); selective
    recompute (``recompute.py``) never chooses them. Computed only for prompts that recompute, so
    the ordinary splice pays nothing for it.
"""

from __future__ import annotations

from collections import Counter

from ...layout import PromptLayout, Span
from ..prefill.plan import PrefillPlan, Segment
from .registry import EncodedSchema

__all__ = ["assemble", "is_exact", "leading_exact", "moves_last"]


def assemble(layout: PromptLayout, entry: EncodedSchema | None, store) -> PrefillPlan:
    """The layout's plan: ``store.get(key) -> (kv, tier)`` for every cached span (keys from
    ``entry``), read in place (segments in KV order), and its new tokens."""
    hits: Counter[str] = Counter()
    segments = []
    cached_spans, new_spans = layout.cached, layout.new  # each is a filter over the spans: once
    for s in cached_spans:
        key = entry.keys[s.schema_index]
        kv, tier = store.get(key)
        hits[tier] += 1
        segments.append(Segment(key, kv, entry.positions[s.schema_index]))
    new_ids = [t for s in new_spans for t in s.token_ids]
    new_pos = [p for s in new_spans for p in s.position_ids]
    if not new_ids:  # recompute the last cached token so there are logits to return
        last, seg = cached_spans[-1], segments[-1]
        new_ids, new_pos = [last.token_ids[-1]], [last.position_ids[-1]]
        segments[-1] = Segment(seg.key + "[:-1]", seg.kv[:, :, :, :-1], seg.positions[:-1])
    exact = _is_exact(cached_spans, new_spans, entry, [s.schema_index for s in cached_spans])
    return PrefillPlan(segments=segments, new_ids=new_ids, new_pos=new_pos, max_position=max(layout.position_ids),
                       exact=exact, layout=layout, hit_tiers=dict(hits))


def moves_last(layout: PromptLayout) -> bool:
    """The prompt has no new token: its last cached token runs as the new one (``assemble``'s rule)."""
    return not any(s.token_ids for s in layout.new)


def is_exact(layout: PromptLayout, entry: EncodedSchema | None) -> bool:
    """Whether ``assemble`` would call the layout exact, without a store lookup."""
    cached = layout.cached
    return _is_exact(cached, layout.new, entry, [s.schema_index for s in cached])


def leading_exact(layout: PromptLayout, entry: EncodedSchema | None) -> int:
    """Tokens of the leading cached spans (prompt order) encoded after exactly the spans before
    them at positions 0..: their states are a plain prefill's."""
    seen: list[int] = []
    n = 0
    for s in layout.spans:
        if s.kind != "cached" or entry.contexts.get(s.schema_index) != tuple(seen) \
                or list(s.position_ids) != list(range(n, n + len(s.position_ids))):
            break
        seen.append(s.schema_index)
        n += len(s.position_ids)
    return n


def _is_exact(cached_spans: list[Span], new_spans: list[Span], entry: EncodedSchema | None,
              order: list[int]) -> bool:
    """True when the assembled state equals a plain prefill of the same tokens: positions run
    0..n-1 in cache order and every cached span was encoded after exactly the spans before it."""
    positions = [p for s in cached_spans + new_spans for p in s.position_ids]
    if positions != list(range(len(positions))):
        return False
    seen: list[int] = []
    for idx in order:
        if entry.contexts.get(idx) != tuple(seen):
            return False
        seen.append(idx)
    return True
