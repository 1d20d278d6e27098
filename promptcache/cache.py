"""SpliceCache: a transformers ``Cache`` over one preallocated buffer the engine fills in place.

Layout of the buffer: ``buf[layer, 0|1, batch, kv_head, slot, head_dim]`` (0 = keys, 1 = values)
and ``positions[batch, slot]``, the position ID of every entry (read by ALiBi adapters).
A stored span is ``[layer, 2, kv_head, n, head_dim]``: copying one into slots [off, off + n) is
one ``copy_``. New tokens are written after the last filled slot; nothing is concatenated.
"""

from __future__ import annotations

import threading

import torch
from transformers.cache_utils import Cache, DynamicLayer

from .models.base import KVSpec


class SpliceLayer(DynamicLayer):
    """One layer's view of the shared buffer. ``n`` is this layer's filled length."""

    def __init__(self, owner: "SpliceCache", index: int):
        super().__init__()
        self.owner, self.index, self.n = owner, index, 0
        self.is_initialized = True
        self.dtype, self.device = owner.buf.dtype, owner.buf.device

    @property
    def keys(self):  # [B, H, n, D] view
        return self.owner.buf[self.index, 0, :, :, : self.n]

    @keys.setter
    def keys(self, value):  # DynamicLayer.__init__ assigns; views are derived
        pass

    @property
    def values(self):
        return self.owner.buf[self.index, 1, :, :, : self.n]

    @values.setter
    def values(self, value):
        pass

    def lazy_initialization(self, key_states, value_states) -> None:
        pass

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        t = key_states.shape[-2]
        self.owner.ensure_capacity(self.n + t)
        buf = self.owner.buf
        buf[self.index, 0, :, :, self.n : self.n + t] = key_states
        buf[self.index, 1, :, :, self.n : self.n + t] = value_states
        self.n += t
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self.n

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.n + query_length, 0

    def crop(self, tokens_to_remove: int) -> None:
        self.n = max(0, self.n + tokens_to_remove) if tokens_to_remove < 0 else min(self.n, tokens_to_remove)

    def reset(self) -> None:
        self.n = 0


class SpliceCache(Cache):
    def __init__(self, spec: KVSpec, capacity: int, batch: int = 1, device="cpu", pin: bool = False):
        shape = (spec.layers, 2, batch, spec.kv_heads, max(capacity, 1), spec.head_dim)
        self.spec, self.batch = spec, batch
        self.buf = torch.empty(shape, dtype=spec.dtype, device=device, pin_memory=pin)
        self.positions = torch.zeros((batch, shape[4]), dtype=torch.long, device=device)
        super().__init__(layers=[SpliceLayer(self, i) for i in range(spec.layers)])

    @property
    def capacity(self) -> int:
        return self.buf.shape[4]

    @property
    def length(self) -> int:
        """Filled slots (all layers agree between forwards)."""
        return self.layers[0].n

    def set_length(self, n: int) -> None:
        assert 0 <= n <= self.capacity, (n, self.capacity)
        for layer in self.layers:
            layer.n = n

    def ensure_capacity(self, n: int) -> None:
        if n <= self.capacity:
            return
        grown = max(n, self.capacity + self.capacity // 2)
        buf = self.buf.new_empty(self.buf.shape[:4] + (grown,) + self.buf.shape[5:])
        buf[..., : self.capacity, :] = self.buf
        pos = self.positions.new_zeros((self.batch, grown))
        pos[:, : self.capacity] = self.positions
        self.buf, self.positions = buf, pos

    def write(self, off: int, kv: torch.Tensor, positions: torch.Tensor, row: int = 0) -> None:
        """Copy a stored span kv [L, 2, H, n, D] into slots [off, off + n) of batch row ``row``."""
        n = kv.shape[3]
        self.ensure_capacity(off + n)
        self.buf[:, :, row, :, off : off + n].copy_(kv, non_blocking=True)
        self.positions[row, off : off + n].copy_(positions, non_blocking=True)

    resident: dict[int, tuple[object, int]] | None = None  # slot offset -> (span key, n), see CachePool

    def resident_match(self, plan: list[tuple[object, int]]) -> int:
        """How many slots of ``plan`` (spans placed from slot 0 on) are already in place."""
        res, off, hit = self.resident or {}, 0, 0
        for key, n in plan:
            if res.get(off) == (key, n):
                hit += n
            off += n
        return hit

    def place(self, spans: list[tuple[object, object, torch.Tensor]]) -> int:
        """Put stored spans (key, kv [L, 2, H, n, D], positions [n]) at slots 0.. in order, copying
        only those not already resident at their slot; set the length. Returns bytes copied.
        ``kv`` may be a zero-argument callable, called only when the span must be copied."""
        old, new, off, copied = self.resident or {}, {}, 0, 0
        self.resident = {}  # until placement completes, nothing in this buffer is trusted
        for key, kv, pos in spans:
            n = len(pos)
            if old.get(off) != (key, n):
                kv = kv() if callable(kv) else kv
                self.write(off, kv, pos)
                copied += kv.numel() * kv.element_size()
            new[off] = (key, n)
            off += n
        self.resident = new
        self.set_length(off)
        return copied

    def read(self, off: int, n: int, row: int = 0) -> torch.Tensor:
        """A copy of slots [off, off + n) of row ``row`` as [L, 2, H, n, D] (contiguous)."""
        return self.buf[:, :, row, :, off : off + n].contiguous()

    def stage_positions(self, position_ids: torch.Tensor) -> None:
        """Record the positions of the next ``T`` entries (position_ids: [B, T])."""
        n, t = self.length, position_ids.shape[1]
        self.ensure_capacity(n + t)
        self.positions[:, n : n + t] = position_ids

    def key_positions(self, query_length: int) -> torch.Tensor:
        """Positions of every key a forward of ``query_length`` new tokens attends to: [B, kv]."""
        return self.positions[:, : self.length + query_length]


class CachePool:
    """Reusable SpliceCaches for one engine, so assembling a prompt copies only what is not in place.

    Each cache remembers which stored spans sit at which slots (``resident``: offset -> (key, n)).
    ``acquire`` hands out the free cache whose residents best match the spans about to be
    assembled; ``SpliceCache.place`` then skips spans already at their slot. Slots past the cached
    part are overwritten by new and generated tokens, so residents are only kept below it.
    Thread-safe: a cache is owned by one prompt between acquire and release.
    """

    granule = 256  # slots; capacities are rounded up to a multiple

    def __init__(self, spec: KVSpec, device, max_free: int = 2, pin: bool = False):
        self.spec, self.device, self.max_free, self.pin = spec, device, max_free, pin
        self._free: list[SpliceCache] = []
        self._lock = threading.Lock()

    def acquire(self, capacity: int, plan: list[tuple[object, int]]) -> SpliceCache:
        """A cache with room for ``capacity`` slots; ``plan``: (key, n) of the spans to place."""
        capacity = -(-capacity // self.granule) * self.granule  # headroom: prompts vary in length
        with self._lock:
            best, score = None, -1
            for c in self._free:
                s = (c.resident_match(plan), c.capacity >= capacity)
                if best is None or s > score:
                    best, score = c, s
            if best is not None and (score[0] > 0 or best.capacity >= capacity):
                self._free.remove(best)
                best.ensure_capacity(capacity)  # growing keeps residents at their slots
                return best
        cache = SpliceCache(self.spec, capacity, device=self.device, pin=self.pin)
        cache.resident = {}
        return cache

    def prewarm(self, capacity: int) -> None:
        """Have a free buffer of at least ``capacity`` slots with its pages already touched, so the
        first prompt does not pay for faulting in fresh memory (tens of ms per 100 MiB on CPU)."""
        capacity = -(-capacity // self.granule) * self.granule
        with self._lock:
            if any(c.capacity >= capacity for c in self._free):
                return
        cache = SpliceCache(self.spec, capacity, device=self.device, pin=self.pin)
        cache.buf.zero_()
        cache.resident = {}
        self.release(cache)

    def release(self, cache: SpliceCache) -> None:
        with self._lock:
            self._free.append(cache)
            while len(self._free) > self.max_free:
                self._free.pop(0)

    def clear(self) -> None:
        """Drop every free buffer (the next prompt allocates and copies everything)."""
        with self._lock:
            self._free.clear()

    def forget_residents(self) -> None:
        """Keep the buffers but forget what they hold (the next prompt copies everything)."""
        with self._lock:
            for c in self._free:
                c.resident = {}
