"""SpliceCache: a transformers ``Cache`` over one preallocated buffer the engine fills in place.

Layout of the buffer: ``buf[layer, 0|1, batch, kv_head, slot, head_dim]`` (0 = keys, 1 = values)
and ``positions[batch, slot]``, the position ID of every entry (read by ALiBi adapters).
A stored span is ``[layer, 2, kv_head, n, head_dim]``: copying one into slots [off, off + n) is
one ``copy_``. Nothing is concatenated. A forward writes its new tokens either after the last
filled slot (the default, the hot path) or at slots the caller names (``slot_write``: tokens in
the middle of an assembled cache are recomputed in place, selective recompute).

This file is over 300 lines because the cache, its transformers layer contract, the buffer pool
and the GPU's overlapped copies (a side stream whose per-layer events ``SpliceLayer.update``
waits on) share one buffer layout; splitting them would spread that layout over four files.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from ..tunables import CAPACITY_GRANULE, COPY_GROUPS


@dataclass(frozen=True)
class KVSpec:
    """Shape of one token's key/value states: per layer, K and V of [kv_heads, head_dim]."""

    layers: int
    kv_heads: int
    head_dim: int
    dtype: torch.dtype

    @property
    def bytes_per_token(self) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * torch.empty((), dtype=self.dtype).element_size()


class SpliceLayer(CacheLayerMixin):
    """One layer's view of the shared buffer; implements transformers' cache-layer contract itself.

    ``n`` is this layer's filled length: slots [0, n) are valid. ``keys``/``values`` are views
    ``[B, H, n, D]`` of the buffer and cannot be assigned. Supported: ``update`` (append, or write
    at the slots of a pending ``SpliceCache.slot_write``), ``get_seq_length``, ``get_mask_sizes``,
    ``get_max_length``, ``crop``, ``reset``. Everything that would move entries between batch rows
    or devices (beam reorder, batch select/repeat, offload/prefetch) raises ``NotImplementedError``:
    the buffer is shared with the engine's bookkeeping, a silent no-op would be a wrong answer.
    """

    is_sliding = False
    is_croppable = True
    is_compileable = False

    def __init__(self, owner: "SpliceCache", index: int):  # no super().__init__: it assigns keys/values
        self.owner, self.index, self.n = owner, index, 0
        self.is_initialized = True  # the buffer is allocated up front

    @property
    def dtype(self) -> torch.dtype:
        return self.owner.buf.dtype

    @property
    def device(self) -> torch.device:
        return self.owner.buf.device

    @property
    def keys(self) -> torch.Tensor:  # [B, H, n, D] view
        return self.owner.buf[self.index, 0, :, :, : self.n]

    @keys.setter
    def keys(self, value):
        _unsupported("assigning keys (they are views of the shared buffer; use SpliceCache.write or update)")

    @property
    def values(self) -> torch.Tensor:  # [B, H, n, D] view
        return self.owner.buf[self.index, 1, :, :, : self.n]

    @values.setter
    def values(self, value):
        _unsupported("assigning values (they are views of the shared buffer; use SpliceCache.write or update)")

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Nothing to allocate (the buffer exists); only check the states fit it."""
        want = (self.owner.batch, self.owner.spec.kv_heads, self.owner.spec.head_dim)
        got = (key_states.shape[0], key_states.shape[1], key_states.shape[-1])
        if got != want:
            raise ValueError(f"SpliceCache layer {self.index}: states [B, H, _, D] = {list(got)} do not fit {list(want)}")

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Store new states [B, H, T, D]; return keys and values over the filled slots [B, H, n, D]."""
        self.owner.wait_layer(self.index)  # this layer's stored spans may still be arriving (overlap)
        pending = self.owner.pending
        if pending is None:  # hot path: append after the filled slots
            t = key_states.shape[-2]
            self.owner.ensure_capacity(self.n + t)
            buf = self.owner.buf
            buf[self.index, 0, :, :, self.n : self.n + t] = key_states
            buf[self.index, 1, :, :, self.n : self.n + t] = value_states
            self.n += t
            return self.keys, self.values
        slots, kv_len = pending
        if slots.shape[-1] != key_states.shape[-2]:
            raise ValueError(f"slot write of {slots.shape[-1]} slots got {key_states.shape[-2]} new states")
        k, v = self.owner.buf[self.index, 0], self.owner.buf[self.index, 1]  # [B, H, S, D] views
        if slots.dim() == 1:
            k.index_copy_(2, slots, key_states.to(k.dtype))
            v.index_copy_(2, slots, value_states.to(v.dtype))
        else:  # one slot list per batch row
            for row in range(slots.shape[0]):
                k[row].index_copy_(1, slots[row], key_states[row].to(k.dtype))
                v[row].index_copy_(1, slots[row], value_states[row].to(v.dtype))
        self.n = kv_len
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self.n

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        """(kv_length, kv_offset) of the mask the model builds itself. Under a slot write the
        adapter always supplies the real mask (and ALiBi bias); the model's own one, sized as for
        an append like its other length bookkeeping, is replaced before attention."""
        return self.n + query_length, 0

    def get_max_length(self) -> int:
        return -1  # grows on demand (ensure_capacity)

    get_max_cache_shape = get_max_length  # the name transformers 5.0 used

    def crop(self, tokens_to_remove: int) -> None:
        """Negative: drop that many trailing entries. Non-negative (transformers' legacy form): keep
        at most that many entries."""
        self.n = max(0, self.n + tokens_to_remove) if tokens_to_remove < 0 else min(self.n, tokens_to_remove)

    def reset(self) -> None:
        self.n = 0

    def offload(self):
        _unsupported("offloading (the engine places the buffer on its device; use CachePool(device=...))")

    def prefetch(self):
        _unsupported("prefetching (SpliceCache is never offloaded)")

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        _unsupported("reordering batch rows (beam search)")

    def batch_repeat_interleave(self, repeats: int) -> None:
        _unsupported("repeating batch rows")

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        _unsupported("selecting batch rows")


def _unsupported(what: str):
    raise NotImplementedError(f"SpliceCache does not support {what}; assemble a new cache instead")


class SpliceCache(Cache):
    """All layers' states in one buffer; ``positions[b, s]`` is the position ID of slot ``s``."""

    def __init__(self, spec: KVSpec, capacity: int, batch: int = 1, device="cpu", pin: bool = False,
                 overlap: bool = False):
        shape = (spec.layers, 2, batch, spec.kv_heads, max(capacity, 1), spec.head_dim)
        self.spec, self.batch, self.overlap = spec, batch, overlap
        self.copy_stream = None  # CUDA only: the side stream host spans are copied on, layer by layer
        self.layer_ready: list | None = None  # CUDA events: layer l's copies are done (None: nothing pending)
        self.copy_groups = COPY_GROUPS  # overlapped copies go in this many groups of layers (tunables.py)
        self.buf = torch.empty(shape, dtype=spec.dtype, device=device, pin_memory=pin)
        self.positions = torch.zeros((batch, shape[4]), dtype=torch.long, device=device)
        self.pending: tuple[torch.Tensor, int] | None = None  # (slots [T] | [B, T], kv_len) during a slot write
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
        self.sync()
        grown = max(n, self.capacity + self.capacity // 2)
        buf = self.buf.new_empty(self.buf.shape[:4] + (grown,) + self.buf.shape[5:])
        buf[..., : self.capacity, :] = self.buf
        pos = self.positions.new_zeros((self.batch, grown))
        pos[:, : self.capacity] = self.positions
        self.buf, self.positions = buf, pos

    def free(self) -> None:
        """Drop the buffer now. Layers point back at their cache (a reference cycle), so without
        this a dropped cache's buffer lives until the cycle collector runs. Unusable afterwards."""
        self.sync()
        self.buf = self.buf.new_empty((0,) * self.buf.dim())
        self.positions = self.positions.new_empty((self.batch, 0))
        self.resident = {}
        self.set_length(0)

    def write(self, off: int, kv: torch.Tensor, positions: torch.Tensor, row: int = 0) -> None:
        """Copy a stored span kv [L, 2, H, n, D] (any float dtype: converted while copying, so
        states stored in bfloat16/float16 land in the model's dtype with no extra copy) into slots
        [off, off + n) of batch row ``row``."""
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

    def place(self, segments) -> int:
        """Put stored segments (``engine.prefill.plan.Segment``: ``key``, ``positions`` [n], ``states()`` ->
        kv [L, 2, H, n, D]) at slots 0.. in order, copying only those not already resident at their
        slot (``states()`` is called only then); set the length. Returns bytes copied.

        With ``overlap`` on a GPU, spans held in host memory are copied on a side stream in groups
        of layers, and layer ``l`` of the next forward waits only for its group's copies
        (``wait_layer``); otherwise every span is one asynchronous copy on the compute stream."""
        old, new, off, copied = self.resident or {}, {}, 0, 0
        self.resident = {}  # until placement completes, nothing in this buffer is trusted
        from_host = []  # (off, kv) copied layer by layer on the side stream
        for seg in segments:
            key, pos, n = getattr(seg, "placed", seg.key), seg.positions, seg.n  # a moved copy: not the stored key
            if old.get(off) != (key, n):
                kv = seg.states()
                if self.overlap and self.buf.is_cuda and not kv.is_cuda:
                    self.ensure_capacity(off + n)  # (``write`` does this itself)
                    from_host.append((off, kv))
                    self.positions[0, off : off + n].copy_(pos, non_blocking=True)
                else:
                    self.write(off, kv, pos)
                copied += kv.numel() * kv.element_size()
            new[off] = (key, n)
            off += n
        if from_host:
            self.copy_layers(from_host)
        self.resident = new
        self.set_length(off)
        return copied

    def copy_layers(self, spans: list[tuple[int, torch.Tensor]]) -> None:
        """Copy host spans (off, kv [L, 2, H, n, D]) into row 0 on the side stream, in
        ``copy_groups`` groups of layers (each group one copy per span: launching a copy costs CPU
        time, so one per layer and span costs more than it hides); record one event per group.
        The side stream first waits for the compute stream, so nothing still reading the buffer
        (an earlier prompt's forward) sees it change."""
        device = self.buf.device
        main = torch.cuda.current_stream(device)
        if self.copy_stream is None:
            self.copy_stream = torch.cuda.Stream(device)
        stream = self.copy_stream
        stream.wait_stream(main)
        layers = self.spec.layers
        step = -(-layers // self.copy_groups)  # layers per group: one copy per span and group
        events = []
        with torch.cuda.stream(stream):
            for lo in range(0, layers, step):
                for off, kv in spans:
                    dst = self.buf[lo : lo + step, :, 0, :, off : off + kv.shape[3]]  # [l, 2, H, n, D]
                    if kv.dtype == dst.dtype:
                        dst.copy_(kv[lo : lo + step], non_blocking=True)
                    else:  # 16-bit stored states cross in their own dtype and are upcast on the GPU
                        dst.copy_(kv[lo : lo + step].to(device, non_blocking=True))
                event = torch.cuda.Event()
                event.record(stream)
                events += [event] * min(step, layers - lo)
        self.layer_ready = events

    def wait_layer(self, layer: int) -> None:
        """Make the current stream wait until ``layer``'s overlapped copies are done (no-op otherwise)."""
        ready = self.layer_ready
        if ready is not None:
            torch.cuda.current_stream(self.buf.device).wait_event(ready[layer])

    def sync(self) -> None:
        """Make the current stream wait for every pending overlapped copy; afterwards any use of
        ``buf`` on it sees the placed spans. Called before the buffer is read, grown or freed."""
        ready = self.layer_ready
        if ready is not None:
            main = torch.cuda.current_stream(self.buf.device)
            for event in ready:
                main.wait_event(event)
            self.layer_ready = None

    def read(self, off: int, n: int, row: int = 0) -> torch.Tensor:
        """A copy of slots [off, off + n) of row ``row`` as [L, 2, H, n, D] (contiguous)."""
        self.sync()
        return self.buf[:, :, row, :, off : off + n].contiguous()

    # -- positions of the next forward ------------------------------------------------------------
    def stage_positions(self, position_ids: torch.Tensor) -> None:
        """Record the positions of the next ``T`` appended entries (position_ids: [B, T])."""
        n, t = self.length, position_ids.shape[1]
        self.ensure_capacity(n + t)
        self.positions[:, n : n + t] = position_ids

    def key_positions(self, query_length: int) -> torch.Tensor:
        """Positions of every key a forward of ``query_length`` appended tokens attends to: [B, kv]."""
        return self.positions[:, : self.length + query_length]

    @contextmanager
    def slot_write(self, position_ids: torch.Tensor, slots: torch.Tensor):
        """For one forward, write the new tokens' states at ``slots`` instead of appending them.

        position_ids: [B, T]; slots: LongTensor [T] (every row) or [B, T], unique per row, >= 0.
        Afterwards the length is ``kv_len = max(length, max(slots) + 1)`` and every layer returns
        keys/values over slots [0, kv_len). Slots at or past the length must fill [length, kv_len)
        exactly (no unwritten gap: its contents would be garbage the attention reads). Yields
        ``kv_len``. Residents overlapping the written slots are forgotten (their states change).
        After an exception inside the block the cache's contents are undefined: release it.
        """
        slots = self._check_slots(position_ids, slots)
        old, top = self.length, int(slots.max()) + 1
        kv_len = max(old, top)
        rows = slots if slots.dim() == 2 else slots[None]
        fresh = (rows >= old).sum(dim=1)
        if bool((fresh != kv_len - old).any()):
            raise ValueError(
                f"slot write would leave unwritten slots: the cache holds {old} entries and the write reaches "
                f"slot {top - 1}, so it must write every slot in [{old}, {kv_len}) (per row, wrote {fresh.tolist()})"
            )
        self.ensure_capacity(kv_len)
        if slots.dim() == 1:
            self.positions[:, slots] = position_ids.to(self.positions.device)
        else:
            self.positions.scatter_(1, slots, position_ids.to(self.positions.device))
        low = int(slots.min())
        if self.resident:
            self.resident = {off: kn for off, kn in self.resident.items() if off + kn[1] <= low}
        self.pending = (slots, kv_len)
        try:
            yield kv_len
        finally:
            self.pending = None
        if any(layer.n != kv_len for layer in self.layers):
            raise RuntimeError(f"slot write: not every layer was written (lengths {[l.n for l in self.layers]})")

    def _check_slots(self, position_ids: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """Slots on the buffer's device, [T] when every row writes the same slots, else [B, T]."""
        b, t = position_ids.shape
        if not isinstance(slots, torch.Tensor) or slots.dtype != torch.long:
            raise ValueError(f"write_slots must be a LongTensor [T] or [B, T], got {type(slots).__name__} "
                             f"{getattr(slots, 'dtype', '')}")
        if slots.shape not in ((t,), (b, t)):
            raise ValueError(f"write_slots must be [T] = [{t}] or [B, T] = [{b}, {t}], got {list(slots.shape)}")
        if b != self.batch:
            raise ValueError(f"a forward of {b} rows on a cache of {self.batch} rows")
        slots = slots.to(self.buf.device)
        if slots.dim() == 2 and bool((slots == slots[:1]).all()):
            slots = slots[0]
        if t and int(slots.min()) < 0:
            raise ValueError(f"write_slots must be >= 0, got {int(slots.min())}")
        rows = slots if slots.dim() == 2 else slots[None]
        if t == 0 or any(int(r.unique().numel()) != t for r in rows):
            raise ValueError("write_slots must be non-empty and name each slot at most once per row")
        return slots


class CachePool:
    """Reusable SpliceCaches for one engine, so assembling a prompt copies only what is not in place.

    Each cache remembers which stored spans sit at which slots (``resident``: offset -> (key, n)).
    ``acquire`` hands out the free cache whose residents best match the spans about to be
    assembled; ``SpliceCache.place`` then skips spans already at their slot. Slots past the cached
    part are overwritten by new and generated tokens, so residents are only kept below it.
    Thread-safe: a cache is owned by one prompt between acquire and release.
    """

    granule = CAPACITY_GRANULE  # slots; capacities are rounded up to a multiple (tunables.py)

    def __init__(self, spec: KVSpec, device, max_free: int = 2, pin: bool = False, overlap: bool = False):
        self.spec, self.device, self.max_free, self.pin, self.overlap = spec, device, max_free, pin, overlap
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
        cache = SpliceCache(self.spec, capacity, device=self.device, pin=self.pin, overlap=self.overlap)
        cache.resident = {}
        return cache

    def prewarm(self, capacity: int, segments=()) -> None:
        """Have a free buffer of at least ``capacity`` slots with its pages already touched, so the
        first prompt does not pay for faulting in fresh memory (tens of ms per 100 MiB on CPU).
        ``segments`` (as for ``SpliceCache.place``) are placed in it at slots 0.. in order: a first
        prompt importing them in that order copies nothing."""
        capacity = -(-capacity // self.granule) * self.granule
        with self._lock:
            fits = [c for c in self._free if c.capacity >= capacity]
            cache = max(fits, key=lambda c: c.resident_match([(seg.key, seg.n) for seg in segments])) if fits else None
            if cache is not None:
                self._free.remove(cache)
        if cache is None:
            cache = SpliceCache(self.spec, capacity, device=self.device, pin=self.pin, overlap=self.overlap)
            cache.buf.zero_()
            cache.resident = {}
        if segments:
            cache.place(segments)
        self.release(cache)

    def release(self, cache: SpliceCache) -> None:
        with self._lock:
            self._free.append(cache)
            while len(self._free) > self.max_free:
                self._free.pop(0).free()

    def clear(self) -> None:
        """Drop every free buffer (the next prompt allocates and copies everything)."""
        with self._lock:
            for c in self._free:
                c.free()
            self._free.clear()

    def forget_residents(self) -> None:
        """Keep the buffers but forget what they hold (the next prompt copies everything)."""
        with self._lock:
            for c in self._free:
                c.resident = {}
