"""Window-aware storage, read side: the stored states a plan's readers need more of than the disk
or Redis tier kept (``store/codec.py``, window-aware storage), replaced by states encoded again.

A tier that trims keeps, in each sliding layer, what a reader at or after a span's last token
sees. A prompt's readers are its new tokens (all of them read every segment, whatever its
position: free text placed before the first module reference, a parameter's argument before a
module) and, when it recomputes, the cached tokens a selection may choose (``RecomputeRequest``:
its candidates, which read the segments before them and the earlier tokens of their own). The
earliest of them bounds what any reader sees; a segment whose entries there were dropped is
replaced by its whole states from ``whole(segment)`` (the planner's encoder), so the prompt reads
exactly what an untrimmed store would give it. Nothing is stored back: the trimmed copy stays
what the tier keeps; the states encoded again are kept in memory (``WholeStates``, least recently
used dropped past ``tunables.WHOLE_STATES_BYTES``), so the next prompt reading them encodes nothing.
"""

from __future__ import annotations

import dataclasses
import logging
from collections import OrderedDict
from typing import Callable

import torch

from ... import tunables
from ...store.codec import readable
from .plan import PrefillPlan, Segment

__all__ = ["WholeStates", "first_reader", "unreadable", "whole_segment", "with_whole_states"]

log = logging.getLogger(__name__)


def first_reader(plan: PrefillPlan, recompute=None) -> int:
    """The smallest position of a token that reads the plan's segments: its new tokens, and the
    candidates of ``recompute`` (a ``RecomputeRequest``) when it has any."""
    first = min(plan.new_pos)
    if recompute is not None and recompute.candidates:
        first = min(first, min(recompute.slot_pos[c] for c in recompute.candidates))
    return first


def unreadable(plan: PrefillPlan, windows, recompute=None) -> list[int]:
    """Indices of the plan's segments that a reader needs dropped entries of (``windows``: the
    trimming tiers' windows per layer; None: nothing is trimmed)."""
    if not windows or not any(w is not None for w in windows):
        return []
    shortest = min(w for w in windows if w is not None)
    long = [i for i, s in enumerate(plan.segments) if s.kv is not None and s.n > shortest]
    if not long:
        return []
    first = first_reader(plan, recompute)
    return [i for i in long if not readable(plan.segments[i].kv, windows, int(plan.segments[i].positions[0]), first)]


def with_whole_states(plan: PrefillPlan, windows, whole: Callable[[Segment], Segment],
                      recompute=None) -> PrefillPlan:
    """``plan``, each unreadable segment replaced by ``whole(segment)`` (a ``whole_segment``)."""
    bad = unreadable(plan, windows, recompute)
    if not bad:
        return plan
    segments = list(plan.segments)
    for i in bad:
        segments[i] = whole(segments[i])
    log.info("window-aware storage: %d stored state(s) encoded again for a reader at position %d",
             len(bad), first_reader(plan, recompute))
    return dataclasses.replace(plan, segments=segments)


def whole_segment(seg: Segment, kv: torch.Tensor, load: Callable[[], torch.Tensor] | None = None) -> Segment:
    """``seg`` reading ``kv`` (its states as encoded, [L, 2, H, n, D], at its stored positions;
    ``load``: their moved copy where ``seg`` is read shifted) under a key of its own, so a private
    buffer that holds the trimmed copy at its slot never mistakes one for the other."""
    return dataclasses.replace(seg, key=f"{seg.key}[whole]", kv=kv.to(device=seg.kv.device, dtype=seg.kv.dtype),
                               load=load)


class WholeStates:
    """Whole states encoded again, by stored key, least recently used dropped first past
    ``limit`` bytes (``tunables.WHOLE_STATES_BYTES``). A state larger than the limit is handed
    back and not kept. Keys are content keys (a state's key names its tokens and positions), so
    an entry never goes stale."""

    def __init__(self, limit: int | None = None):
        self.limit = tunables.WHOLE_STATES_BYTES if limit is None else limit
        self._kept: OrderedDict[str, torch.Tensor] = OrderedDict()
        self._bytes = 0

    def get(self, key: str, encode: Callable[[], torch.Tensor]) -> torch.Tensor:
        """The whole states of ``key``: kept ones, else ``encode()`` (then kept if they fit)."""
        kv = self._kept.get(key)
        if kv is not None:
            self._kept.move_to_end(key)
            return kv
        kv = encode()
        size = kv.numel() * kv.element_size()
        if size <= self.limit:
            self._kept[key] = kv
            self._bytes += size
            while self._bytes > self.limit:
                _, old = self._kept.popitem(last=False)
                self._bytes -= old.numel() * old.element_size()
        return kv

    def __contains__(self, key: str) -> bool:
        return key in self._kept

    def __len__(self) -> int:
        return len(self._kept)

    @property
    def nbytes(self) -> int:
        return self._bytes
