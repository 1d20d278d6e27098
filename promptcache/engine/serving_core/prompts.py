"""What a request asks the engine to prefill: a ``PromptSpec``, planned by the scheduler at admission.

A spec is data (the prompt and where its stored states are looked up) with the one question the
scheduler asks it, on the engine's thread, when the request is admitted: ``plan(pool) ->
PrefillPlan``, the stored segments read in place (pool entries, or a store tier's own tensors)
and the rows to run (new tokens, and the cached tokens a drifted prompt recomputes, in prompt
order: ``engine/prefill/ordered.py``).

Three kinds here, one in ``rag`` (``DocumentPrompt``, for ``DocumentStore`` documents):
``PmlPrompt`` (a PML prompt over a loaded schema), ``TokenPrompt`` (token ids at positions 0..n-1:
chat turns, completions, and the baseline ``use_cache=False``, which reuses nothing), and
``PrefilledPrompt`` (a prefill the caller already ran with ``keep_cache=True``: studies that read
a prompt's logits and then decode from the same state).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from ...layout import PromptLayout
from ...pml.nodes import Prompt
from ..prefill.plan import PrefillPlan, PromptSpec, Segment
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

    def plan(self, pool) -> PrefillPlan:
        return self.pc.plan(self.tree, self.namespace, recompute=self.recompute, layout=self.layout)


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
    """A prefill the caller already ran with ``keep_cache=True`` (studies that read a prompt's
    logits, then decode from the same state): its buffer is read in place as one stored segment
    and decoding starts from its logits (nothing is run or copied). The buffer is handed over,
    once: it is not given back to the runner's buffers."""

    result: PrefillResult

    def __post_init__(self):
        cache = self.result.cache
        if cache is None or not hasattr(cache, "buf"):
            raise ValueError("PrefilledPrompt needs a PrefillResult that kept its assembled cache "
                             "(PromptCache.prefill(..., keep_cache=True) or DocumentStore.prefill(..., keep_cache=True))")

    def plan(self, pool) -> PrefillPlan:
        res, cache = self.result, self.result.cache
        cache.sync()
        n = cache.length
        kv = cache.buf[:, :, 0, :, :n]  # [L, 2, H, n, D]
        seg = Segment(f"prefilled:{next(_prefilled)}", kv, cache.positions[0, :n])
        return PrefillPlan(segments=[seg], new_ids=[], new_pos=[], max_position=res.next_position - 1, exact=res.exact,
                           layout=res.layout, hit_tiers=dict(res.hit_tiers), logits=res.logits)


_prefilled = itertools.count()  # PrefilledPrompt segments' keys: each buffer read by its request alone
