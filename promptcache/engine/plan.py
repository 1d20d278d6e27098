"""``PrefillPlan``: what one prompt's prefill reads and runs, whoever planned it.

Three planners produce it: PML schema prompts (``PromptCache.plan``), token chains (the
server's automatic prefix reuse and ``DocumentStore`` chains: ``chains.ChainPlanner``) and, for
prompts that must be assembled in a private buffer first (selective recompute, independent
documents), any ``start(reserve) -> PrefillResult`` (``ServingScheduler`` copies that result into
the request's own blocks). The serving scheduler takes a plan and nothing else.

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

from ..layout import PromptLayout

__all__ = ["PrefillPlan", "PromptSpec", "Segment"]


@dataclass(eq=False)
class Segment:
    """Stored states a prompt reads: ``key`` names them (content key or chain block key)."""

    key: str
    kv: torch.Tensor | None  # [L, 2, H, n, D] (None: already a shared entry of the pool under ``key``)
    positions: torch.Tensor  # [n] position IDs
    promote: bool = False  # copy into the pool even where it could be read in place (small chain
    # blocks: in the pool, consecutive blocks form one run that attention reads as one view)

    @property
    def n(self) -> int:
        return len(self.positions)


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
