"""Automatic prefix reuse for plain token prompts (vLLM-style automatic prefix caching).

A prompt's tokens are cut into blocks of ``block_size`` tokens from position 0, keyed as a chain
(``engine.chains.ChainPlanner``): equal keys mean an equal token prefix, so a stored block's
states are what a plain prefill computes there, and reuse is exact up to float rounding.

Two ways to serve a prompt, picked by the backend:
  * ``plan(ids, namespace)`` (the serving scheduler, every model whose attention can read the KV
    pool): blocks live in the pool, shared in place by every request that matches them; a
    finished request's prompt and answer blocks join them; blocks the pool evicts go down the
    store's tiers (``spill``) and come back on use.
  * ``prefill(ids, namespace, reserve)`` (the older per-request path, models the pool cannot
    serve): the longest chain of stored blocks is copied into a private buffer, the rest runs on
    top, and the prompt's new full blocks are read back and stored in ``pc.store``.
At least one token always runs, so there are logits.
"""

from __future__ import annotations

import logging
import time
from typing import Callable

import torch

from ..tunables import BLOCK_SIZE
from .chains import ChainPlanner, stored_run

log = logging.getLogger(__name__)

DEFAULT_BLOCK_SIZE = BLOCK_SIZE  # tunables.py: the server's and chat's default


class PrefixCache:
    """Hash-chained token blocks; ``plan`` for the serving scheduler, ``starter`` for the older
    path. Thread-safe as far as the store is (blocks are immutable once stored)."""

    def __init__(self, pc, block_size: int = DEFAULT_BLOCK_SIZE):
        self.pc, self.block_size = pc, block_size
        self.chains = ChainPlanner(pc.store, pc.model_key, block_size)
        self.blocks_stored = 0  # blocks this cache put into the store (a counter for /metrics)

    def keys(self, ids: list[int], namespace: str) -> list[str]:
        """Chained keys of the full blocks of ``ids`` (len(ids) // block_size of them)."""
        return self.chains.keys(ids, namespace)

    def plan(self, ids: list[int], namespace: str):
        """``plan(pool) -> PrefillPlan`` for the serving scheduler."""
        if not ids:
            raise ValueError("a prompt needs at least one token")
        return lambda pool: self.chains.plan(ids, namespace, pool)

    def spill(self, key: str, kv: torch.Tensor) -> None:
        """A block the pool evicts goes down the store's tiers (and comes back from there)."""
        self.pc.store.put(key, kv)
        self.blocks_stored += 1

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
        found, hits = stored_run(self.pc.store, keys[: (len(ids) - 1) // b])  # kv: [L, 2, H, B, D]
        cached = [(key, kv, torch.arange(i * b, (i + 1) * b, device=self.pc.device))
                  for i, (key, kv) in enumerate(found)]
        m = len(found)
        res = self.pc.run_spliced(cached, ids[m * b :], list(range(m * b, len(ids))), len(ids) - 1, t0,
                                  reserve, keep_cache=True, exact=True, hit_tiers=dict(hits))
        for i in range(m, len(keys)):  # cache slot == position: the kept cache holds the prompt in order
            if keys[i] not in self.pc.store:
                self.pc.store.put(keys[i], res.cache.read(i * b, b))
                self.blocks_stored += 1
        log.debug("prefix: %d of %d tokens from %d stored blocks", m * b, len(ids), m)
        return res

    def starter(self, ids: list[int], namespace: str) -> Callable[[int], object]:
        """``start(reserve) -> PrefillResult`` for ``pc.stream_from`` / ``pc.generate_from``."""
        return lambda reserve: self.prefill(ids, namespace, reserve)
