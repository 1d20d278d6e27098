"""A PML prompt or a RAG question as a vLLM completions request: token ids, the states to supply, the salt.

``to_vllm_request(pc, prompt)`` lays the prompt out with ``pc`` (a ``PromptCache`` holding its
schema, the same model and tokenizer vLLM serves) and returns the keyword arguments of the
official client's ``completions.create(model=..., max_tokens=..., **request)``.
``to_vllm_request(store, (question, doc_ids), system=...)`` does the same for a ``DocumentStore``
(persisted, ``attach_separator=True``: ``documents``). A prompt whose layout cannot be supplied
(``supply.supply`` or the store says why) is still a valid request: vLLM computes its tokens in
full, at positions 0..n-1, and the reason is logged.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from ...keys import model_digest
from ...rag import DocumentStore, DocumentStoreError
from .documents import document_supply
from .keyed import keyed_params
from .supply import PARAMS_KEY, Supply, SupplyError, supply

__all__ = ["VllmRequest", "plan_request", "to_vllm_request"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class VllmRequest:
    """A prompt as vLLM gets it: ``kwargs`` for ``completions.create``; ``supply`` None with
    ``reason`` when vLLM computes it in full."""

    token_ids: list[int]
    supply: Supply | None
    reason: str | None = None

    @property
    def kwargs(self) -> dict:
        extra = {}
        if self.supply is not None:
            extra = {"kv_transfer_params": {PARAMS_KEY: self.supply.params}, "cache_salt": self.supply.salt}
        return {"prompt": list(self.token_ids), "extra_body": extra}


def plan_request(source, prompt, namespace: str | None = None, *, system: str | None = None,
                 by_key: bool = False) -> VllmRequest:
    """``prompt`` as a vLLM request: PML text or a file (as ``pc.layout`` takes it) for a
    ``PromptCache`` ``source``; a ``(question, doc_ids)`` pair (``system``: the system text) for a
    ``DocumentStore``. ``by_key``: name the states by their content keys in the engine's store,
    for a connector that reads that engine's Redis or spill folder (``keyed``), instead of by
    compiled schema or document folder."""
    if isinstance(source, DocumentStore):
        return _plan_documents(source, prompt, system, by_key)
    layout = source.layout(prompt, namespace)
    try:
        md = model_digest(source.model_key)
        planned = supply(layout, md)
        if by_key:
            head = [s for s in layout.spans if s.kind == "cached"]  # supply(): the cached spans lead
            keys = source.schema(layout.schema.name, namespace).keys
            states = [(keys[s.schema_index], len(s), planned.offset) for s in head]
            planned = Supply(keyed_params(md, states), planned.tokens, planned.offset)
        return VllmRequest(layout.token_ids, planned)
    except SupplyError as e:
        log.warning("promptcache: vLLM computes this prompt in full: %s", e)
        return VllmRequest(layout.token_ids, None, str(e))


def _plan_documents(store: DocumentStore, prompt, system: str | None, by_key: bool) -> VllmRequest:
    if not (isinstance(prompt, (tuple, list)) and len(prompt) == 2 and isinstance(prompt[0], str)):
        raise TypeError(f"a DocumentStore's request is a (question, doc_ids) pair, got {type(prompt).__name__}")
    question, doc_ids = prompt
    try:
        if store.path is None and not by_key:
            raise DocumentStoreError("a store without a path has no folder for the connector to read (give it a "
                                     "path, or send by_key=True to a connector that reads its engine's Redis)")
        layout = store.served_layout(question, list(doc_ids), system)
        planned = document_supply(store, layout)
    except (DocumentStoreError, SupplyError) as e:
        log.warning("promptcache: vLLM computes this prompt in full: %s", e)
        return VllmRequest(store.layout(question, list(doc_ids), system).token_ids, None, str(e))
    if by_key:
        cached = [s for s in layout.spans if s.kind == "cached"]
        states = [(store.state_key(s.token_ids), len(s), s.position_ids[0]) for s in cached]
        planned = Supply(keyed_params(planned.params["model"], states), planned.tokens, 0)
    return VllmRequest(layout.token_ids, planned)


def to_vllm_request(source, prompt, namespace: str | None = None, *, system: str | None = None,
                    by_key: bool = False) -> dict:
    """Keyword arguments for ``client.completions.create(model=..., max_tokens=..., **request)``:
    ``prompt`` (the layout's token ids) and ``extra_body`` (``kv_transfer_params`` and ``cache_salt``
    when vLLM is given stored states; empty when it computes the prompt in full, reason logged).
    ``source`` and ``prompt`` as ``plan_request`` takes them."""
    return plan_request(source, prompt, namespace, system=system, by_key=by_key).kwargs
