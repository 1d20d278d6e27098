"""``DocumentPrompt``: a question over ``DocumentStore`` documents, as the engine's scheduler plans it.

Chain stores are exact (every state a plain prefill's), so their prompt is planned as a token
chain (``engine.serving_core.chains``, the prefix reuse the server uses for plain prompts): blocks shared in
the KV pool by every request that matches them, published as requests fill them. Independent and
hybrid stores read documents encoded alone (moved to their positions) and recompute part of
their states as the request's own prefill rows (``DocumentStore.plan``).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..engine import PromptSpec, TokenPrompt
from ..engine.serving_core.prefix import PrefixCache
from ..layout import PromptLayout

__all__ = ["DocumentPrompt"]


@dataclass(frozen=True, eq=False)
class DocumentPrompt(PromptSpec):
    store: object  # the DocumentStore (store.py) that holds the documents
    question: str
    doc_ids: tuple[str, ...]
    system: str | None = None
    recompute: float | str | None = None
    prefix: PrefixCache | None = None  # the chains of the engine that runs it (None: the library's engine)
    layout: PromptLayout | None = None  # an exact store's prompt, laid out when the request was made

    def plan(self, pool):
        if not self.store.exact:  # documents reused out of their context: part recomputed as rows of the step
            return self.store.plan(self.question, list(self.doc_ids), self.system, recompute=self.recompute)
        layout = self.layout if self.layout is not None else self.store.layout(self.question, list(self.doc_ids),
                                                                                self.system)
        pc = self.store.pc
        prefix = self.prefix if self.prefix is not None else pc.engine().prefix
        return TokenPrompt(pc, tuple(layout.token_ids), self.store.namespace, prefix, layout).plan(pool)
