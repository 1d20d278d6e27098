"""Automatic prefix reuse for plain token prompts (vLLM-style automatic prefix caching).

A prompt's tokens are cut into blocks of ``block_size`` tokens from position 0. Block i's key
chains the key of block i-1 with block i's token IDs, the namespace and the model
(``pc.model_key``): equal keys mean an equal token prefix, so a stored block's states (computed
at positions [i*B, (i+1)*B) after exactly that prefix) are what a plain prefill computes there.
Blocks live in the engine's tiered store (``pc.store``) under its budgets and LRU, beside the
schema modules.

Serving a prompt: the longest chain of stored blocks that prefixes it is placed (positions
contiguous from 0), the remaining tokens run on top (``pc.run_spliced``), then the prompt's full
blocks not stored yet are read from the kept cache and stored. The state equals a plain prefill
(causal attention; the same tokens at the same positions), so reuse is exact up to float
rounding. At least one token always runs, so there are logits: a prompt made only of stored
full blocks recomputes its last block.
"""

from __future__ import annotations

import logging
import time
from typing import Callable

import torch

from ..keys import chain_key, chain_root
from ..store import StoreError

log = logging.getLogger(__name__)

DEFAULT_BLOCK_SIZE = 64


class PrefixCache:
    """Hash-chained token blocks over ``pc.store``; ``start(ids, namespace)`` plugs into
    ``pc.stream_from``. Thread-safe as far as the store is (blocks are immutable once stored)."""

    def __init__(self, pc, block_size: int = DEFAULT_BLOCK_SIZE):
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1 token, got {block_size}")
        self.pc, self.block_size = pc, block_size
        self.blocks_stored = 0  # blocks this cache put into the store (a counter for /metrics)

    def keys(self, ids: list[int], namespace: str) -> list[str]:
        """Chained keys of the full blocks of ``ids`` (len(ids) // block_size of them)."""
        b, parent, out = self.block_size, chain_root(self.pc.model_key, namespace), []
        for i in range(len(ids) // b):
            parent = chain_key(parent, ids[i * b : (i + 1) * b], i * b)
            out.append(parent)
        return out

    def match(self, ids: list[int], namespace: str) -> int:
        """Number of leading blocks of ``ids`` already stored (at most (len(ids) - 1) // B, so
        one token at least is left to run)."""
        n = 0
        for key in self.keys(ids[: max(len(ids) - 1, 0)], namespace):
            if key not in self.pc.store:
                break
            n += 1
        return n

    def prefill(self, ids: list[int], namespace: str, reserve: int = 0):
        """Prefill ``ids`` (positions 0..n-1) from the stored blocks plus one forward of the rest;
        returns the engine's PrefillResult holding its cache (``keep_cache``); stores new blocks."""
        if not ids:
            raise ValueError("a prompt needs at least one token")
        t0 = time.perf_counter()
        b, keys = self.block_size, self.keys(ids, namespace)
        m, cached, hits = 0, [], {}
        for key in keys[: (len(ids) - 1) // b]:
            try:
                kv, tier = self.pc.store.get(key)  # kv: [L, 2, H, B, D]; one lookup, no separate membership test
            except StoreError:  # not stored (or no longer): the chain ends here
                break
            hits[tier] = hits.get(tier, 0) + 1
            cached.append((key, kv, torch.arange(m * b, (m + 1) * b, device=self.pc.device)))
            m += 1
        res = self.pc.run_spliced(cached, ids[m * b :], list(range(m * b, len(ids))), len(ids) - 1, t0,
                                  reserve, keep_cache=True, exact=True, hit_tiers=hits)
        for i in range(m, len(keys)):  # cache slot == position: the kept cache holds the prompt in order
            if keys[i] not in self.pc.store:
                self.pc.store.put(keys[i], res.cache.read(i * b, b))
                self.blocks_stored += 1
        log.debug("prefix: %d of %d tokens from %d stored blocks", m * b, len(ids), m)
        return res

    def starter(self, ids: list[int], namespace: str) -> Callable[[int], object]:
        """``start(reserve) -> PrefillResult`` for ``pc.stream_from`` / ``pc.generate_from``."""
        return lambda reserve: self.prefill(ids, namespace, reserve)
