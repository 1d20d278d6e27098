"""``DocumentPrompt``: a question over ``DocumentStore`` documents, as frozen data.

A reuse (independent or hybrid) store registers itself with the engine's planner
(``engine/planner.py``) and plans its prompts at admission: documents' stored states (encoded
after ``encode_prefix``, or alone) read in place at their positions, part of their states recomputed as the request's own prefill rows
(``DocumentStore.plan_prompt``). An exact (chain) store's prompt is a ``TokenPrompt`` that reuses
the engine's prefix chains (``DocumentStore.prompt``): it never reaches here.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..engine import SourcePrompt

__all__ = ["DocumentPrompt"]


@dataclass(frozen=True, eq=False)
class DocumentPrompt(SourcePrompt):
    """``source``: the name the store was registered under with the planner (``DocumentStore.source``)."""

    question: str
    doc_ids: tuple[str, ...]
    system: str | None = None
    recompute: float | str | None = None
