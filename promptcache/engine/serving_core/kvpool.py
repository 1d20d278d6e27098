"""``KVPool``: one preallocated pool of fixed-size KV blocks that running requests reference.

Layout: ``buf[layer, 0|1, kv_head, slot, head_dim]`` with ``slot = block * block_size + i``
(0 = keys, 1 = values). Pages of a CPU pool are touched only when written, so a large pool
costs resident memory only for the blocks in use.

Ownership. A block is free, owned by one running request (its new and generated tokens), or
owned by a *shared entry*: states several requests may read in place, found by content key
(a chain block key or a module span key). An entry counts the requests reading it (``refs``);
an entry nobody reads is *idle* and stays in the pool, in LRU order, until its blocks are
needed: then it is evicted, and ``spill(key, kv)`` (when given) hands its states down to the
store's tiers first, so a later request finds them there and they are promoted back on use.
An idle entry whose key is ``pinned(key)`` (an Anthropic ``cache_control`` breakpoint's TTL) is
not evicted while the pin lives.
A *copy* entry (``promote(copy=True)``) holds states a store tier keeps and attention could read
there, copied in so that a step without the native CPU kernel reads them in its one attention call
a layer (``ServingScheduler.pools_documents``): it is freed when its last reader releases it.

Allocation prefers one contiguous run of blocks (a request's own tokens then form one run, and
attention reads a run as one view, and so does every later request that reads those tokens as a
shared prompt). When no free run is long enough, idle entries are evicted, least recently used
first, until one is (up to twice the blocks asked for): after a pool has filled, free space lies
in pieces between idle entries, and a 4K-token prompt allocated from the pieces was read as 120
segments, concatenated a layer at a time at every decode step, which made each token about half
again as slow (eval/results/design_figures.md). Only when that opens no run does it take the longest free runs first (the fewest pieces).
Nothing here is thread-safe: the serving scheduler's one thread owns the pool.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Callable

import torch

from ...models.splice import KVSpec
from ...errors import PromptCacheError
from ...tunables import BLOCK_SIZE
from .dense import DecodePlans

log = logging.getLogger(__name__)

__all__ = ["KVPool", "PoolFull", "SharedEntry", "runs"]


class PoolFull(PromptCacheError, RuntimeError):
    """A request needs more blocks than the whole pool holds (it could never be admitted)."""

    exit_code = 2


@dataclass(eq=False)
class SharedEntry:
    key: str
    blocks: list[int]  # in token order
    n: int  # tokens held (the last block may be partial)
    positions: torch.Tensor  # [n] position IDs of the entry's tokens
    refs: int = 0  # requests reading it now
    views: list[torch.Tensor] = field(default_factory=list)  # runs as [L, 2, H, k, D] views
    # a copy of states a store tier keeps and attention could read there (``promote(copy=True)``): dropped
    # as soon as nobody reads it, never idle nor spilled
    copy: bool = False


def runs(blocks: list[int]) -> list[tuple[int, int]]:
    """Maximal runs of consecutive block ids as (first block, count), in order."""
    out: list[list[int]] = []
    for b in blocks:
        if out and out[-1][0] + out[-1][1] == b:
            out[-1][1] += 1
        else:
            out.append([b, 1])
    return [(a, k) for a, k in out]


class KVPool:
    def __init__(self, spec: KVSpec, device, tokens: int, block_size: int = BLOCK_SIZE,
                 spill: Callable[[str, torch.Tensor], None] | None = None,
                 pinned: Callable[[str], bool] | None = None):
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1 token, got {block_size}")
        if tokens < block_size:
            raise ValueError(f"the pool must hold at least one block ({block_size} tokens), got {tokens}")
        self.spec, self.block_size, self.spill, self.pinned = spec, block_size, spill, pinned
        self.num_blocks = tokens // block_size
        shape = (spec.layers, 2, spec.kv_heads, self.num_blocks * block_size, spec.head_dim)
        self.buf = torch.empty(shape, dtype=spec.dtype, device=device)  # untouched pages cost nothing on CPU
        # each layer's (keys, values) [Hk, S, D] views, made once: every step's attention reads them
        self.layers: list[torch.Tensor] = list(self.buf.unbind(0))  # and as one [2, Hk, S, D] view a layer
        self.layer_kv: list[tuple[torch.Tensor, torch.Tensor]] = [(b[0], b[1]) for b in self.layers]
        self._free: list[int] = list(range(self.num_blocks))  # sorted
        self._entries: dict[str, SharedEntry] = {}
        self._idle: OrderedDict[str, SharedEntry] = OrderedDict()  # refs == 0, least recently used first
        self.evictions = 0
        # the last decode step's plan over this pool's slots, grown in place while its rows continue
        self.decode_plans = DecodePlans(block_size)

    # -- capacity ---------------------------------------------------------------------------------
    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    @property
    def free_blocks(self) -> int:
        """Blocks free now (not counting idle entries' blocks, which eviction can free)."""
        return len(self._free)

    @property
    def available_blocks(self) -> int:
        """Blocks an allocation could get: free ones plus those of idle, unpinned entries."""
        return len(self._free) + sum(len(e.blocks) for e in self._idle.values() if not self._is_pinned(e.key))

    def _is_pinned(self, key: str) -> bool:
        return self.pinned is not None and self.pinned(key)

    def allocate(self, count: int) -> list[int] | None:
        """``count`` blocks for a request (None: not available even after evicting idle entries)."""
        if count > self.num_blocks:
            raise PoolFull(f"{count} blocks of {self.block_size} tokens are needed, the KV pool holds "
                           f"{self.num_blocks} ({self.num_blocks * self.block_size} tokens); raise the pool size")
        if count > self.available_blocks:
            return None
        free_runs = runs(self._free)
        if not any(k >= count for _, k in free_runs):  # (with a run that fits, nothing is evicted)
            self._open_run(count)
            while len(self._free) < count:
                self._evict_one()
            free_runs = runs(self._free)
        return self._take(count, free_runs)

    def _open_run(self, count: int) -> None:
        """Evict idle, unpinned entries, least recently used first, until ``count`` free blocks
        lie in one run; it stops once ``2 * count`` blocks' worth are evicted (the free pieces
        then do). A pinned entry or a block in use splits runs: no eviction joins across it."""
        free, budget = set(self._free), 2 * count
        for key in [k for k in self._idle if not self._is_pinned(k)]:
            if budget <= 0:
                return
            blocks = self._idle[key].blocks
            self._evict(key)
            budget -= len(blocks)
            free.update(blocks)
            for first, k in runs(sorted(blocks)):  # the free run around each piece, walked once
                lo, hi = first, first + k - 1
                while lo - 1 in free:
                    lo -= 1
                while hi + 1 in free:
                    hi += 1
                if hi - lo + 1 >= count:
                    return

    def free(self, blocks: list[int]) -> None:
        """Give a request's own blocks back."""
        if blocks:
            self._free = sorted(self._free + list(blocks))

    def _take(self, count: int, free_runs: list[tuple[int, int]]) -> list[int]:
        """``count`` free blocks (``free_runs``: ``runs`` of the free list): the first run long
        enough, else the longest runs first (the fewest pieces: attention reads each piece of a
        shared prompt as its own segment)."""
        fit = next(((a, k) for a, k in free_runs if k >= count), None)
        chosen, left = [], count
        for first, k in [fit] if fit else sorted(free_runs, key=lambda r: -r[1]):
            take = min(k, left)
            chosen += range(first, first + take)
            left -= take
            if not left:
                break
        taken = set(chosen)
        self._free = [b for b in self._free if b not in taken]
        return chosen

    # -- views ------------------------------------------------------------------------------------
    def views(self, blocks: list[int], n: int) -> list[torch.Tensor]:
        """The first ``n`` tokens of ``blocks`` as [L, 2, H, k, D] views, one per contiguous run."""
        out, left, bs = [], n, self.block_size
        for first, count in runs(blocks):
            k = min(left, count * bs)
            if k <= 0:
                break
            out.append(self.buf[:, :, :, first * bs : first * bs + k])
            left -= k
        return out

    def slots(self, blocks: list[int], start: int, end: int) -> torch.Tensor:
        """Pool slots of tokens [start, end) of a block list: LongTensor [end - start]."""
        idx = torch.arange(start, end)
        table = torch.tensor(blocks, dtype=torch.long)
        return (table[idx // self.block_size] * self.block_size + idx % self.block_size).to(self.buf.device)

    def slot_runs(self, blocks: list[int], n: int) -> list[tuple[int, int]]:
        """The slots of tokens [0, n) of a block list as runs (first slot, count), in order: what
        ``slots(blocks, 0, n)`` holds, as Python ints."""
        out, left, bs = [], n, self.block_size
        for first, count in runs(blocks):
            k = min(left, count * bs)
            if k <= 0:
                break
            out.append((first * bs, k))
            left -= k
        if left > 0:
            raise ValueError(f"{len(blocks)} blocks of {bs} tokens cannot hold {n} tokens")
        return out

    def write(self, blocks: list[int], start: int, kv: torch.Tensor) -> None:
        """Copy states kv [L, 2, H, n, D] into tokens [start, start + n) of ``blocks``."""
        n, off, bs = kv.shape[3], 0, self.block_size
        for first, count in runs(blocks):
            lo, hi = first * bs, (first + count) * bs  # slots of this run; token index of lo = off
            a, b = max(start, off), min(start + n, off + count * bs)
            if a < b:
                self.buf[:, :, :, lo + a - off : lo + b - off].copy_(kv[:, :, :, a - start : b - start],
                                                                     non_blocking=True)
            off += hi - lo

    # -- shared entries ---------------------------------------------------------------------------
    def __contains__(self, key: str) -> bool:
        return key in self._entries

    def acquire(self, key: str) -> SharedEntry | None:
        """The entry under ``key``, now read by one more request (None: not in the pool)."""
        e = self._entries.get(key)
        if e is not None:
            e.refs += 1
            self._idle.pop(key, None)
        return e

    def release(self, entry: SharedEntry) -> None:
        """One reader fewer; an entry nobody reads becomes idle (most recently used)."""
        assert entry.refs > 0, entry.key
        entry.refs -= 1
        if entry.refs == 0 and self._entries.get(entry.key) is entry:
            if entry.copy:  # the store keeps the states: the copy goes at once
                del self._entries[entry.key]
                self.free(entry.blocks)
                return
            self._idle[entry.key] = entry

    def publish(self, key: str, blocks: list[int], n: int, positions: torch.Tensor) -> SharedEntry | None:
        """Make ``blocks`` (a request's own, holding ``n`` tokens) a shared entry; it starts idle.
        Returns None (and the caller keeps the blocks) when the key is already present."""
        if key in self._entries:
            return None
        e = SharedEntry(key, list(blocks), n, positions, views=self.views(blocks, n))
        self._entries[key] = self._idle[key] = e
        return e

    def promote(self, key: str, kv: torch.Tensor, positions: torch.Tensor, copy: bool = False) -> SharedEntry | None:
        """Copy stored states kv [L, 2, H, n, D] into new blocks as an entry read by one request
        (None: no room now). ``copy``: states a store tier keeps (a document read on the dense path:
        ``ServingScheduler.pools_documents``): the entry's blocks are freed when its last reader
        releases it, not kept idle or spilled."""
        blocks = self.allocate(self.blocks_for(kv.shape[3]))
        if blocks is None:
            return None
        self.write(blocks, 0, kv)
        e = SharedEntry(key, blocks, kv.shape[3], positions, refs=1, views=self.views(blocks, kv.shape[3]), copy=copy)
        self._entries[key] = e
        return e

    def _evict_one(self, pins: bool = True) -> None:
        """Evict the least recently used idle entry (skipping pinned ones unless ``pins`` is False)."""
        self._evict(next(k for k in self._idle if not (pins and self._is_pinned(k))))

    def _evict(self, key: str) -> None:
        """Evict the idle entry ``key``: its states go down the store's tiers, its blocks are free."""
        e = self._idle.pop(key)
        del self._entries[key]
        if self.spill is not None:
            try:
                self.spill(key, torch.cat(e.views, dim=3) if len(e.views) > 1 else e.views[0].clone())
            except Exception as err:  # noqa: BLE001 - a failed spill loses a cache entry, never an answer
                log.warning("KV pool: spilling %s failed (%s); its states are dropped", key, err)
        self.free(e.blocks)
        self.evictions += 1

    def clear_idle(self) -> None:
        """Evict every idle entry, pinned ones too (shutdown hands them all down to the store)."""
        while self._idle:
            self._evict_one(pins=False)

    def describe(self) -> dict:
        """A snapshot of every block for a viewer (the studio's cache view): ``state[b]`` is
        "free", "request" (a running request's own) or "entry"; ``entries`` lists the shared
        entries as {key, blocks, tokens, refs, idle, pinned}. Safe to call from another thread
        than the pool's: each container is copied by one C-level call (atomic under the GIL), so
        the snapshot may be one step old but never raises for a dict changed mid-read."""
        free, entries, idle = list(self._free), list(self._entries.values()), set(self._idle)
        state = ["request"] * self.num_blocks
        for b in free:
            state[b] = "free"
        rows = []
        for e in entries:
            for b in e.blocks:
                state[b] = "entry"
            rows.append({"key": e.key, "blocks": list(e.blocks), "tokens": e.n, "refs": e.refs,
                         "idle": e.key in idle, "pinned": self._is_pinned(e.key)})
        return {"block_size": self.block_size, "state": state, "entries": rows, "evictions": self.evictions}

    def stats(self) -> dict[str, int]:
        return {"blocks": self.num_blocks, "free": len(self._free), "entries": len(self._entries),
                "idle_entries": len(self._idle), "evictions": self.evictions}
