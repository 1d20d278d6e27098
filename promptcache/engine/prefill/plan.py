"""``PrefillPlan``: what one prompt's prefill reads and runs, whoever planned it.

One planner (``engine/planner.py``) produces it for every request: PML schema prompts
(``assemble.assemble``) and token chains (the server's automatic prefix reuse and ``DocumentStore`` chains:
``chains.ChainPlanner``); a prompt that recomputes part of its stored states gets its plan in
prompt order from ``ordered.ordered_plan``. The serving scheduler reads every plan from the pool
and the store; ``PromptCache.prefill`` assembles the same plan in a private buffer
(``ModelRunner.prefill_spliced``) for the logits alone.

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
    order: int | None = None  # prompt index of its first token (its tokens are consecutive in prompt
    # order); read only by a plan that runs in prompt order (``PrefillPlan.new_order``)
    shift: int = 0  # ``kv`` holds the states encoded ``shift`` positions earlier (at ``positions -
    # shift``): the pool reads them in place at any position (each query rotated back by ``shift``
    # for that segment on rotary models; ALiBi reads ``positions``), a private buffer places
    # ``load()`` (the states moved to ``positions``)
    # a run of another stored segment (``ordered.py`` cuts a segment around its recomputed tokens): (that
    # segment's key, its states [L, 2, H, N, D], the run's first token in them); ``kv`` is that run. A
    # pool that holds stored segments (``ServingScheduler.pools_documents``) holds the whole one once
    part_of: tuple[str, torch.Tensor, int] | None = None

    @property
    def n(self) -> int:
        return len(self.positions)

    @property
    def placed(self) -> str:
        """What a private buffer holding ``states()`` holds: the key, and the shift it was moved by."""
        return f"{self.key}>{self.shift}" if self.shift else self.key

    def states(self) -> torch.Tensor:
        """The segment's states at ``positions`` [L, 2, H, n, D] (``load``-ed when not held, or
        moved by ``shift``)."""
        if self.kv is not None and not self.shift:
            return self.kv
        if self.shift and self.load is None:
            raise RuntimeError(f"segment {self.key} is read shifted by {self.shift} and has no moved copy")
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
    # selective recompute (``engine/prefill/ordered.py``): the prompt index of each new token (the
    # recomputed cached tokens and the prompt's new tokens, ascending). A query then sees only the
    # keys at or before it in prompt order (segments by ``Segment.order``; its own tokens causally).
    # None: every new token sees every segment (the paper's splice).
    new_order: list[int] | None = None
    recomputed: int = 0  # of ``new_ids``, the cached tokens computed afresh (their stored copies are not read)

    @property
    def cached_tokens(self) -> int:
        """Tokens read from stored states."""
        return sum(s.n for s in self.segments)

    def __post_init__(self):
        if not self.new_ids or len(self.new_ids) != len(self.new_pos):
            raise ValueError(f"a plan runs at least one new token with a position each "
                             f"(got {len(self.new_ids)} ids, {len(self.new_pos)} positions)")
        if self.new_order is not None:
            if len(self.new_order) != len(self.new_ids) or any(s.order is None for s in self.segments):
                raise ValueError(f"a plan in prompt order gives an order to each of its {len(self.new_ids)} new "
                                 f"tokens (got {len(self.new_order)}) and to every segment")
            if any(b <= a for a, b in zip(self.new_order, self.new_order[1:])):
                raise ValueError("a plan's new tokens run in prompt order (new_order ascending)")


@dataclass(frozen=True, eq=False)
class PromptSpec:
    """What a request asks the engine to prefill: frozen data (``serving_core/prompts.py`` has the
    kinds), planned by the engine's planner (``engine/planner.py``) at admission."""
