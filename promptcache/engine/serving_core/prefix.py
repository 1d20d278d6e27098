"""Automatic prefix reuse for plain token prompts (vLLM-style automatic prefix caching).

A prompt's tokens are cut into blocks of ``block_size`` tokens from position 0, keyed as a chain
(``engine.serving_core.chains.ChainPlanner``): equal keys mean an equal token prefix, so a stored block's
states are what a plain prefill computes there, and reuse is exact up to float rounding.

A ``TokenPrompt`` with ``reuse`` is planned (``engine/planner.py``) through ``chains.plan(ids, namespace, pool)``: blocks live in the KV
pool, shared in place by every request that matches them; a request's prompt and answer blocks
join them as they fill; blocks the pool evicts go down the store's tiers (``spill``) and come
back on use. At least one token always runs, so there are logits.
"""

from __future__ import annotations

import torch

from ...tunables import BLOCK_SIZE
from .chains import ChainPlanner

DEFAULT_BLOCK_SIZE = BLOCK_SIZE  # tunables.py: the server's and chat's default


class PrefixCache:
    """Hash-chained token blocks of one engine: their keys, the planner, and where evicted blocks
    go. Thread-safe as far as the store is (blocks are immutable once stored)."""

    def __init__(self, store, model_key: str, block_size: int = DEFAULT_BLOCK_SIZE):
        """``store``: the engine's tiered store (blocks evicted from the pool go there);
        ``model_key``: the model part of every chain key."""
        self.store, self.block_size = store, block_size
        self.chains = ChainPlanner(store, model_key, block_size)
        self.blocks_stored = 0  # blocks this cache put into the store (a counter for /metrics)

    def keys(self, ids: list[int], namespace: str) -> list[str]:
        """Chained keys of the full blocks of ``ids`` (len(ids) // block_size of them)."""
        return self.chains.keys(ids, namespace)

    def spill(self, key: str, kv: torch.Tensor) -> None:
        """A block the pool evicts goes down the store's tiers (and comes back from there)."""
        self.store.put(key, kv)
        self.blocks_stored += 1
