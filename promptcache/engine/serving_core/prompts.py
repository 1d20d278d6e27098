"""What a request asks the engine to prefill: a ``PromptSpec``, frozen data.

A spec holds the prompt and where its stored states are looked up (a namespace, a recompute
setting, document ids), never an engine, a store or a ``PromptCache``. The scheduler asks the
engine's one planner (``engine/planner.py``) for the spec's ``PrefillPlan`` at admission, on the
step thread: the stored segments read in place (pool entries, or a store tier's own tensors) and
the rows to run (new tokens, and the cached tokens a drifted prompt recomputes, in prompt order:
``engine/prefill/ordered.py``).

Three kinds here, one in ``rag`` (``DocumentPrompt``, a ``SourcePrompt`` for ``DocumentStore``
documents): ``PmlPrompt`` (a PML prompt over a loaded schema), ``TokenPrompt`` (token ids at
positions 0..n-1: chat turns, completions, and the baseline ``use_cache=False``, which reuses
nothing) and ``SourcePrompt`` (planned by a source registered with the planner under ``source``).
"""

from __future__ import annotations

from dataclasses import dataclass

from ...layout import PromptLayout
from ...pml.nodes import Prompt
from ..prefill.plan import PromptSpec

__all__ = ["PmlPrompt", "PromptSpec", "SourcePrompt", "TokenPrompt"]


@dataclass(frozen=True, eq=False)
class PmlPrompt(PromptSpec):
    """A parsed PML prompt over a schema loaded in ``namespace`` (None: the engine's own)."""

    tree: Prompt
    namespace: str | None = None
    recompute: float | str | None = None  # None: the engine's RecomputeConfig
    layout: PromptLayout | None = None  # laid out already (checked when the request was made)


@dataclass(frozen=True, eq=False)
class TokenPrompt(PromptSpec):
    """Token ids at positions 0..n-1. With ``reuse`` its leading full blocks are reused from the
    pool or the store (exact prefix reuse, the chains of the engine that runs it) and its own
    blocks are shared as they fill; without, it reuses and shares nothing (the baseline: every
    token runs). ``layout``: reported in results."""

    ids: tuple[int, ...]
    namespace: str
    reuse: bool = False
    layout: PromptLayout | None = None

    def __post_init__(self):
        if not self.ids:
            raise ValueError("a prompt needs at least one token")


@dataclass(frozen=True, eq=False)
class SourcePrompt(PromptSpec):
    """A prompt a registered source plans (``Planner.add_source``): ``source`` is its name there."""

    source: str
