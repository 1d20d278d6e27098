"""``PrefillPlan``: what one prompt's prefill reads and runs, whoever planned it.

Two planners produce it: PML schema prompts (``assemble.assemble``, through ``PromptCache.plan``)
and token chains (the server's automatic prefix reuse and ``DocumentStore`` chains:
``chains.ChainPlanner``). The serving scheduler reads a plan from the pool and the store; a prompt
that recomputes part of its stored states is instead assembled in a private buffer from the same
plan (``ModelRunner.prefill_spliced``), and the scheduler copies that buffer into the request's own
blocks.

A plan's ``segments`` are stored states read in place, in KV order; ``new_ids`` run after them
at ``new_pos``. ``publish`` (chains only) names the keys under which the request's own full
blocks may be shared once it finishes: ``publish(token_ids) -> [key per full block]``, where
``token_ids`` are the tokens its own region holds (prompt tokens after the segments, then the
generated tokens that ran), so the next turn of a chat reuses its prompt and its answer.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from ...layout import PromptLayout

__all__ = ["PrefillPlan", "PromptSpec", "Segment"]


@dataclass(eq=False)
class Segment:
    """Stored states a prompt reads: ``key`` names them (content key or chain block key)."""

    key: str
    kv: torch.Tensor | None  # [L, 2, H, n, D] (None: already a shared entry of the pool under ``key``,
    # or given by ``load``)
    positions: torch.Tensor  # [n] position IDs
    promote: bool = False  # copy into the pool even where it could be read in place (small chain
    # blocks: in the pool, consecutive blocks form one run that attention reads as one view)
    load: Callable[[], torch.Tensor] | None = None  # gives ``kv`` when it is needed (a private buffer
    # that already holds the segment at its slot never calls it)

    @property
    def n(self) -> int:
        return len(self.positions)

    def states(self) -> torch.Tensor:
        """The segment's states [L, 2, H, n, D] (``load``-ed when not held)."""
        if self.kv is not None:
            return self.kv
        if self.load is None:
            raise RuntimeError(f"segment {self.key} holds no states (a pool entry's key)")
        return self.load()


@dataclass(eq=False, kw_only=True)
class PrefillPlan:
    segments: list[Segment]
    new_ids: list[int]  # [T], T >= 1
    new_pos: list[int]  # [T]
    max_position: int  # the prompt's largest position (generation continues after it)
    exact: bool  # the states equal a plain prefill of the same tokens
    layout: PromptLayout | None = None
    publish: Callable[[list[int]], list[str]] | None = None
    hit_tiers: dict[str, int] = field(default_factory=dict)

    @property
    def cached_tokens(self) -> int:
        return sum(s.n for s in self.segments)

    def __post_init__(self):
        if not self.new_ids or len(self.new_ids) != len(self.new_pos):
            raise ValueError(f"a plan runs at least one new token with a position each "
                             f"(got {len(self.new_ids)} ids, {len(self.new_pos)} positions)")


class PromptSpec:
    """What a request asks the engine to prefill, planned by the scheduler at admission
    (``prompts.py`` has the kinds): ``plan(pool)`` -> a ``PrefillPlan`` read from the pool and the
    store, or None for a prompt assembled in a private buffer first, which ``prefill()`` runs
    (a ``PrefillResult`` holding its cache)."""

    def plan(self, pool) -> PrefillPlan | None:
        raise NotImplementedError

    def prefill(self):
        raise NotImplementedError(f"{type(self).__name__} always plans into the pool")
