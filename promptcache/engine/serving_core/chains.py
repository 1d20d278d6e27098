"""``ChainPlanner``: token prompts at positions 0..n-1 as chains of fixed-size blocks.

Block i of a prompt holds tokens [i*B, (i+1)*B); its key chains the key of block i-1 with block
i's token IDs (``keys.chain_key``), rooted in the model and the namespace (``chain_root``): equal
keys mean an equal token prefix, so a stored block's states are what a plain prefill computes
there and reuse is exact. The server's automatic prefix reuse and its ``documents`` prompts in
chain mode both plan through it.

The mechanism under it is two functions that every chain in the package uses (token blocks here
and in ``prefix.py``, documents of any length in ``rag``): ``chained`` keys consecutive pieces
after a parent, ``stored_run`` finds the leading keys the store holds.

``plan(ids, namespace, pool)`` matches the longest chain of leading blocks held by the KV pool
(read in place) or by the store's tiers (promoted into the pool on admission), leaves at least
one token to run (there must be logits), and names how the request's own full blocks are keyed
when it finishes (``PrefillPlan.publish``): the prompt's remaining blocks and then its answer's,
so the next turn of a chat, which repeats both, finds them.
"""

from __future__ import annotations

from collections import Counter

import torch

from ...keys import chain_key, chain_root
from ...store import StoreError
from ...tunables import BLOCK_SIZE
from ..prefill.plan import PrefillPlan, Segment

__all__ = ["ChainKeys", "ChainPlanner", "chained", "stored_run"]


def chained(parent: str, pieces) -> list[str]:
    """Keys of consecutive ``pieces`` ``(token_ids, start position)`` after the key ``parent``:
    piece i's key hashes piece i-1's key (``parent`` for the first), its IDs and its start."""
    out = []
    for ids, start in pieces:
        parent = chain_key(parent, ids, start)
        out.append(parent)
    return out


def stored_run(store, keys) -> tuple[list[tuple[str, torch.Tensor]], Counter]:
    """``([(key, kv)], tier hits)`` of the leading ``keys`` the store holds, in order: the first
    key it does not hold (or no longer) ends the run. One ``get`` a key, no membership test."""
    found, hits = [], Counter()
    for key in keys:
        try:
            kv, tier = store.get(key)  # kv: [L, 2, H, n, D]
        except StoreError:
            break
        found.append((key, kv))
        hits[tier] += 1
    return found, hits


class ChainKeys:
    """``PrefillPlan.publish`` of a chain plan: keys of the full blocks of ``ids`` (their first token
    at position ``start``) after the key ``parent``. A request's own tokens only grow (prompt, then
    answer) and the scheduler asks for their keys every step, so blocks already keyed are kept:
    each block is hashed once. A call whose tokens are not an extension of those keyed before
    starts over (never a stale key)."""

    def __init__(self, block_size: int, parent: str, start: int):
        self.block_size, self.parent, self.start = block_size, parent, start
        self.ids: list[int] = []  # the tokens of the blocks keyed so far
        self.keys: list[str] = []

    def __call__(self, ids: list[int]) -> list[str]:
        b, done = self.block_size, len(self.ids)
        if ids[:done] != self.ids:
            self.ids, self.keys, done = [], [], 0
        n = len(ids) // b
        if n * b > done:
            self.ids.extend(ids[done : n * b])
            self.keys += chained(self.keys[-1] if self.keys else self.parent,
                                 [(ids[i * b : (i + 1) * b], self.start + i * b) for i in range(done // b, n)])
        return self.keys[:n]


class ChainPlanner:
    def __init__(self, store, model_key: str, block_size: int = BLOCK_SIZE):
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1 token, got {block_size}")
        self.store, self.model_key, self.block_size = store, model_key, block_size

    def keys(self, ids: list[int], namespace: str) -> list[str]:
        """Chained keys of the full blocks of ``ids`` (a prompt at positions 0..)."""
        return ChainKeys(self.block_size, chain_root(self.model_key, namespace), 0)(ids)

    def plan(self, ids: list[int], namespace: str, pool) -> PrefillPlan:
        """The prompt's plan over ``pool`` (a ``KVPool``; membership tests only) and the store."""
        if not ids:
            raise ValueError("a prompt needs at least one token")
        b, keys = self.block_size, self.keys(ids, namespace)
        segments, hits = [], Counter()
        for i, key in enumerate(keys[: (len(ids) - 1) // b]):
            pos = torch.arange(i * b, (i + 1) * b)
            if key in pool:
                segments.append(Segment(key, None, pos, promote=True))
                hits["pool"] += 1
                continue
            try:
                kv, tier = self.store.get(key)  # [L, 2, H, B, D]
            except StoreError:  # not stored (or no longer): the chain ends here
                break
            segments.append(Segment(key, kv, pos, promote=True))
            hits[tier] += 1
        m = len(segments) * b
        parent = keys[len(segments) - 1] if segments else None
        return PrefillPlan(segments=segments, new_ids=list(ids[m:]), new_pos=list(range(m, len(ids))),
                           max_position=len(ids) - 1, exact=True, hit_tiers=dict(hits),
                           publish=ChainKeys(b, parent or chain_root(self.model_key, namespace), m))
