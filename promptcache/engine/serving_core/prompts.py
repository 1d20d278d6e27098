"""What a request asks the engine to prefill: a ``PromptSpec``, planned by the scheduler at admission.

A spec is data (the prompt and where its stored states are looked up) with the two questions the
scheduler asks it, on the engine's thread, when the request is admitted:

  * ``plan(pool) -> PrefillPlan | None``: the stored segments read in place (pool entries, or a
    store tier's own tensors) and the new tokens to run; None when the prompt must be assembled in
    a private buffer first (it recomputes part of its cached states);
  * ``prefill() -> PrefillResult``: that private prefill, holding its cache (the scheduler copies
    its states into the request's own blocks and gives the buffer back).

Three kinds here, one in ``rag`` (``DocumentPrompt``, for ``DocumentStore`` documents):
``PmlPrompt`` (a PML prompt over a loaded schema), ``TokenPrompt`` (token ids at positions 0..n-1:
chat turns, completions, and the baseline ``use_cache=False``, which reuses nothing), and
``PrefilledPrompt`` (a prefill the caller already ran with ``keep_cache=True``: studies that read
a prompt's logits and then decode from the same state).
"""

from __future__ import annotations

from dataclasses import dataclass

from ...layout import PromptLayout
from ...pml.nodes import Prompt
from ..prefill.plan import PrefillPlan, PromptSpec
from .prefix import PrefixCache
from ..prefill.results import PrefillResult

__all__ = ["PmlPrompt", "PrefilledPrompt", "PromptSpec", "TokenPrompt"]


@dataclass(frozen=True, eq=False)
class PmlPrompt(PromptSpec):
    """A parsed PML prompt over a schema loaded in ``namespace`` (None: the engine's own)."""

    pc: object  # the PromptCache (facade.py) whose schemas it imports
    tree: Prompt
    namespace: str | None = None
    recompute: float | str | None = None  # None: the engine's RecomputeConfig
    layout: PromptLayout | None = None  # laid out already (checked when the request was made)

    def plan(self, pool) -> PrefillPlan | None:
        return self.pc.plan(self.tree, self.namespace, recompute=self.recompute, layout=self.layout)

    def prefill(self) -> PrefillResult:
        return self.pc.prefill(self.tree, keep_cache=True, namespace=self.namespace, recompute=self.recompute,
                               layout=self.layout)


@dataclass(frozen=True, eq=False)
class TokenPrompt(PromptSpec):
    """Token ids at positions 0..n-1. With ``prefix`` its leading full blocks are reused from the
    pool or the store (exact prefix reuse) and its own blocks are shared as they fill; without, it
    reuses and shares nothing (the baseline: every token runs). ``layout``: reported in results."""

    pc: object  # the PromptCache (facade.py) it runs on
    ids: tuple[int, ...]
    namespace: str
    prefix: PrefixCache | None = None
    layout: PromptLayout | None = None

    def __post_init__(self):
        if not self.ids:
            raise ValueError("a prompt needs at least one token")

    def plan(self, pool) -> PrefillPlan:
        ids = list(self.ids)
        if self.prefix is not None:
            plan = self.prefix.chains.plan(ids, self.namespace, pool)
            plan.layout = self.layout
            return plan
        return PrefillPlan(segments=[], new_ids=ids, new_pos=list(range(len(ids))), max_position=len(ids) - 1,
                           exact=True, layout=self.layout)


@dataclass(frozen=True, eq=False)
class PrefilledPrompt(PromptSpec):
    """A prefill already run with ``keep_cache=True`` (its cache is handed over, once)."""

    result: PrefillResult

    def __post_init__(self):
        if self.result.cache is None:
            raise ValueError("PrefilledPrompt needs a PrefillResult that kept its cache (keep_cache=True)")

    def plan(self, pool) -> None:
        return None

    def prefill(self) -> PrefillResult:
        return self.result
