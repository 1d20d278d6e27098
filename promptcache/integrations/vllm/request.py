"""A PML prompt as a vLLM completions request: token ids, the states to supply, and the salt.

``to_vllm_request(pc, prompt)`` lays the prompt out with ``pc`` (a ``PromptCache`` holding its
schema, the same model and tokenizer vLLM serves) and returns the keyword arguments of the
official client's ``completions.create(model=..., max_tokens=..., **request)``. A prompt whose
layout cannot be supplied (``supply.supply`` says why) is still a valid request: vLLM computes
its tokens in full, at positions 0..n-1, and the reason is logged.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from ...keys import model_digest
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


def plan_request(pc, prompt, namespace: str | None = None) -> VllmRequest:
    """``prompt`` (PML text or a file, as ``pc.layout`` takes it) as a vLLM request."""
    layout = pc.layout(prompt, namespace)
    try:
        return VllmRequest(layout.token_ids, supply(layout, model_digest(pc.model_key)))
    except SupplyError as e:
        log.warning("promptcache: vLLM computes this prompt in full: %s", e)
        return VllmRequest(layout.token_ids, None, str(e))


def to_vllm_request(pc, prompt, namespace: str | None = None) -> dict:
    """Keyword arguments for ``client.completions.create(model=..., max_tokens=..., **request)``:
    ``prompt`` (the layout's token ids) and ``extra_body`` (``kv_transfer_params`` and ``cache_salt``
    when vLLM is given stored states; empty when it computes the prompt in full, reason logged)."""
    return plan_request(pc, prompt, namespace).kwargs
