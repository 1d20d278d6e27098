"""One attention call a layer for a step's rows, their keys gathered from the KV pool by slot.

Without the native CPU kernel (the path a GPU takes: every op a kernel launch), reading each shared
segment and each earlier part of a row as its own attention call, each followed by a log-sum-exp
merge, cost dozens of ops per row and layer (eval/host_overhead.py). Here the step's metadata is
built once (``dense_step``) and every layer runs one padded attention over it (``attend_dense``):

  * each row's keys are its shared segments that live in the pool (a view into the pool's buffer,
    read as its run of slots: ``pool_run``; else ``PagedRow.shared_slots``) followed by its own
    tokens, as one slot list padded to the step's longest: ``slots`` [B * W]. Built from Python
    ints where the rows carry their block tables (``PagedRow.own_blocks``, the scheduler's rows):
    one tensor of runs expanded in a constant number of ops (``run_slots``), whatever B; else a
    concatenation of a tensor a part. A layer gathers its keys and values in one indexing of its
    [2, Hk, S, D] pool buffer;
  * each row's queries are padded to the step's longest row (``qidx``: the packed query each
    padded one reads; ``back``: where each packed query lies among the padded ones);
  * one additive bias [Hk * B, G * T, W] says which key each query sees: every key of a shared
    segment, or the first ``limits[i]`` of a segment read in prompt order (selective recompute's
    rows, ``PagedRow.shared_limits``); its own tokens causally (query i of a row with ``done``
    earlier tokens sees own tokens 0 .. done + i); nothing of the padding;
  * a segment read at another position than the one it was encoded at (``PagedRow.shared_shift``)
    has its gathered keys rotated forward by the shift (``cos``/``sin``, one row a key, built once a
    step): rotary scores depend only on the difference of positions, so this equals rotating the
    queries back by it, as the per-part path does.

A decode batch's step is kept across steps (``DecodePlans``, one a pool: ``KVPool.decode_plans``):
when the next step's rows are the same requests one token further, each row's new key is appended
in place (its slot into ``slots``, its column unmasked: three tensor ops a step whatever B) instead
of rebuilding the step from the rows (~1 ms of host time at 48 rows). It is built with
``SPARE_KEYS`` padded keys a row beyond the longest (masked until used), and rebuilt when a row
outgrows them or the batch's membership changes (a request finished, paused or joined, a prefill
chunk in the step). The same requests are recognized by what the scheduler hands every step
unchanged (the request's block table, its shared segments, their runs and shifts: the same
objects, held here so their ids cannot be reused), each own part exactly one token longer, and the
block tables' contents equal; a step repeated on the very same rows gets the kept step as it is.

A step whose one padded call would exceed ``tunables.DENSE_MAX`` scores (48 decode rows padded to
the queries of a prefill row of a hundred beside them) is attended in groups instead (``dense_steps``):
the decode rows in one call, the prefill rows by falling length in calls that each fit, each group's
output written at its queries. Only a row alone past the bound keeps the per-part path: before the
groups, a RAG batch's admission steps on a GPU took it, ~12,000 small attention calls and merges for
48 questions (eval/results/cuda_checks_2026-11-28b.md).

Softmax runs in float32 as matrix products (scores, max, exp, sum, product, divide), and the
log-sum-exp comes back too where segments held outside the pool (a store tier's tensors) are
still merged in afterwards by the caller. The scheduler copies such segments into the pool on this
path (``ServingScheduler.pools_documents``: a RAG batch's documents, once each, whole), so they
are merged in only where the pool had no room for them or the switch is off. Attention that reads key positions beyond rotation
(ALiBi, sliding windows: ``paged.KeyRule``) keeps the per-part path.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

__all__ = ["DecodePlans", "DenseStep", "SPARE_KEYS", "attend_dense", "dense_groups", "dense_step", "dense_steps",
           "on_device", "pool_run", "rotate", "rotation", "run_slots"]

log = logging.getLogger(__name__)

SPARE_KEYS = 16  # padded keys a row beyond the longest when a decode plan is built: a rebuild every 16 steps


@dataclass(frozen=True)
class DenseStep:
    """A step's metadata for ``attend_dense``, built once a step on the pool's device."""

    rows: int  # B
    queries: int  # T: queries a row, padded
    width: int  # W: keys a row, padded
    slots: torch.Tensor  # [B * W] pool slot of each key (0 at padding)
    mask: torch.Tensor  # [B, 1, T, W] float32: 0 where the query sees the key, -inf elsewhere
    qidx: torch.Tensor | None  # [B * T] packed query of each padded query (None: one query a row, in order)
    back: torch.Tensor | None  # [N] padded index of each packed query (None: as qidx)
    cos: torch.Tensor | None = None  # [B, W, r] float32 rotation of each key (None: nothing shifted)
    sin: torch.Tensor | None = None  # [B, W, r] float32, signs folded in for the rotate-half form
    swap: bool = False  # the rotation covers every channel (r = D): halves swapped by a flip
    # keys each row read when built (the first ``lengths[i]`` of its W); a decode plan kept across steps
    # (``DecodePlans``) grows ``slots`` and ``mask`` in place past them and counts on itself
    lengths: tuple[int, ...] = ()
    memo: dict = field(default_factory=dict)  # ``mask`` as ``bias`` and ``batched_bias`` give it
    # the layers' buffers (``_Work``), made at the first layer and kept while the step is (a grown
    # decode step keeps them: its shapes do not change)
    work: dict = field(default_factory=dict)

    def bias(self, kv_heads: int, groups: int) -> torch.Tensor:
        """``mask`` as every layer adds it to the scores of queries [Hk, B, G * T, D]: [1, B, G * T, W],
        broadcast over the KV heads (built at the first layer)."""
        if groups not in self.memo:
            b, _, t, w = self.mask.shape
            self.memo[groups] = self.mask.expand(b, groups, t, w).reshape(1, b, groups * t, w)
        return self.memo[groups]

    def batched_bias(self, kv_heads: int, groups: int) -> torch.Tensor:
        """``bias`` as [Hk * B, G * T, W], for batched matrix products (built at the first layer)."""
        if (kv_heads, groups) not in self.memo:
            _, b, gt, w = self.bias(kv_heads, groups).shape
            self.memo[kv_heads, groups] = self.memo[groups].expand(kv_heads, b, gt, w).reshape(kv_heads * b, gt, w)
        return self.memo[kv_heads, groups]


def pool_run(buf: torch.Tensor, view: torch.Tensor) -> tuple[int, int] | None:
    """(first slot, count) of the pool slots a segment view [L, 2, Hk, n, D] reads, where it is a
    run of the pool's buffer ``buf`` [L, 2, Hk, S, D] (None: a tensor of its own, as a store
    tier's). From the tensors' metadata alone (no tensor op; called for every segment of every row
    of a step)."""
    at = view.data_ptr() - buf.data_ptr()  # bytes: a run of buf's memory lies inside it
    if at < 0 or at >= buf.nbytes or view.stride() != buf.stride() or view.dtype != buf.dtype:
        return None
    vs, bs = view.shape, buf.shape
    if len(vs) != 5 or vs[0] != bs[0] or vs[1] != bs[1] or vs[2] != bs[2] or vs[4] != bs[4] \
            or view.device != buf.device:
        return None
    start, rest = divmod(at, buf.stride(3) * buf.element_size())
    if rest or start + vs[3] > bs[3]:
        return None
    return start, vs[3]


def run_slots(runs: list[list[tuple[int, int]]], width: int, dev) -> torch.Tensor:
    """Each row's keys given as runs of pool slots (first slot, count), as one slot list padded to
    ``width`` a row with slot 0: [len(runs) * width]. Built from Python ints in a constant number
    of tensor ops whatever the rows (one tensor of the runs, expanded on ``dev``), not a
    concatenation of a tensor a run."""
    starts, dests, lens = [], [], []
    before = 0  # keys of the runs before this one
    for r, row in enumerate(runs):
        at = r * width
        for first, count in row:
            if count:
                starts.append(first - before)
                dests.append(at - before)
                lens.append(count)
                at += count
                before += count
    slots = torch.zeros(len(runs) * width, dtype=torch.long, device=dev)
    if not before:
        return slots
    meta = torch.tensor([starts, dests, lens], dtype=torch.long, device=dev)  # [3, R]
    # per key: its run's (first - keys before it, destination - keys before it), plus its index
    per_key = meta[:2].repeat_interleave(meta[2], dim=1, output_size=before).add_(
        torch.arange(before, device=dev))
    return slots.index_put_((per_key[1],), per_key[0])


Slots = "tuple[int, int] | torch.Tensor"  # a run of pool slots (first, count), or the slots themselves


def on_device(data, dev: torch.device, dtype: torch.dtype = torch.long) -> torch.Tensor:
    """``data`` (a list, or nested lists, of numbers) as a tensor on ``dev``. On a GPU through pinned
    memory, copied without blocking: a copy from pageable memory first waits for every kernel queued
    before it, which would hold the launch of a step queued ahead of the last one's end
    (``ServingScheduler.overlap``) until that step is done. (The pinned buffer is not reused before
    its copy has run: torch's pinned allocator records the copy.)"""
    if dev.type != "cuda":
        return torch.tensor(data, dtype=dtype, device=dev)
    return torch.tensor(data, dtype=dtype).pin_memory().to(dev, non_blocking=True)


def _count(slots) -> int:
    return slots[1] if isinstance(slots, tuple) else slots.shape[0]  # ``shape[0]``: ``len`` of a tensor is a call


def _as_tensor(slots, dev) -> torch.Tensor:
    if isinstance(slots, tuple):
        return torch.arange(slots[0], slots[0] + slots[1], dtype=torch.long, device=dev)
    return slots if slots.device == dev else slots.to(dev)


def dense_step(rows: list, segments: list[list[tuple[Slots, int, torch.Tensor | None]]], kv_heads: int,
               head_dim: int, rope: torch.Tensor | None, dev, most: int,
               owns: list[list[tuple[int, int]] | torch.Tensor] | None = None, spare: int = 0) -> DenseStep | None:
    """The metadata of a step of ``rows`` (``PagedRow``), ``segments[r]``: row r's shared segments
    read from the pool, in order, as (slots: a run (first, count) or a LongTensor [n], shift,
    limits [t] or None); ``owns[r]``: row r's own slots as runs (first, count), or None / a
    tensor: ``rows[r].own``. Where every slot is given as runs (the scheduler's rows) the step's
    slot list is built from Python ints in a constant number of ops (``run_slots``), else by
    concatenating a tensor a part. ``spare``: padded keys a row beyond the longest (masked; a
    decode plan kept across steps grows into them). None where the padded scores of one query head a KV head would
    exceed ``most`` elements (the caller keeps the per-part path)."""
    b = len(rows)
    ts = [len(r.ids) for r in rows]
    owns = _owns(rows, owns)
    sizes, n_own = _key_counts(segments, owns)
    n_shared = [sum(x) for x in sizes]
    lens = [n + o for n, o in zip(n_shared, n_own)]
    t, w = max(ts), max(lens) + spare
    size = kv_heads * b * t * w
    if size > most:
        log.info("a step of %d rows (%d queries, %d keys at most a row) would pad %d scores a layer (more than %d): "
                 "its attention runs part by part", b, t, w, size, most)
        return None
    if all(isinstance(o, list) for o in owns) and all(isinstance(s, tuple) for segs in segments for s, _, _ in segs):
        slots = run_slots([[s for s, _, _ in segs] + o for segs, o in zip(segments, owns)], w, dev)  # [B * W]
    else:  # one concatenation of every row's slots and its padding (slot 0, masked)
        pad = torch.zeros(w, dtype=torch.long, device=dev)
        pieces = []
        for segs, o, n in zip(segments, owns, lens):
            pieces += [_as_tensor(s, dev) for s, _, _ in segs]
            pieces += ([_as_tensor(x, dev) for x in o] if isinstance(o, list) else [_as_tensor(o, dev)])
            pieces.append(pad[: w - n])
        slots = torch.cat(pieces)  # [B * W]
    # the first query index of its row that sees each key: done + i sees own key i (shared keys, before
    # the own ones, come out <= 0: seen by every query); nobody (t) sees padding
    before, length = torch.tensor([[n + o - q for n, o, q in zip(n_shared, n_own, ts)], lens], dtype=torch.long,
                                  device=dev).unsqueeze(2).unbind(0)  # [B, 1] each
    j = torch.arange(w, device=dev)
    first = (j - before).clamp_(min=0).masked_fill_(j >= length, t)  # [B, W]
    sees = torch.arange(t, device=dev).view(t, 1) >= first.unsqueeze(1)  # [B, T, W]
    for r, segs in enumerate(segments):
        at = 0
        for (s, _, limits), n in zip(segs, sizes[r]):
            if limits is not None:  # query i sees the segment's first limits[i] keys
                lim = limits.to(dev, torch.long)
                if bool(((lim < 0) | (lim > n)).any()):
                    raise ValueError(f"key limits of a shared segment of {n} tokens must lie in 0..{n}, "
                                     f"got {lim.tolist()}")
                sees[r, : ts[r], at : at + n] = torch.arange(n, device=dev)[None, :] < lim[:, None]
            at += n
    mask = torch.zeros((b, 1, t, w), dtype=torch.float32, device=dev).masked_fill_(
        sees.logical_not_().unsqueeze(1), float("-inf"))
    qidx = back = None
    if t > 1:
        starts = [0]
        for n in ts[:-1]:
            starts.append(starts[-1] + n)
        qidx = torch.tensor([a + min(i, n - 1) for a, n in zip(starts, ts) for i in range(t)], device=dev)
        back = torch.tensor([r * t + i for r, n in enumerate(ts) for i in range(n)], device=dev)
    cos = sin = None
    swap = False
    if rope is not None and any(sh for segs in segments for _, sh, _ in segs):
        counts, shifts = [], []
        for segs, seg_sizes, n in zip(segments, sizes, n_shared):
            counts += seg_sizes
            shifts += [sh for _, sh, _ in segs]
            counts.append(w - n)  # own tokens and padding: not rotated
            shifts.append(0)
        # a row per part, not per key, then repeated to the keys in one go
        both = torch.stack(rotation(torch.tensor(shifts, dtype=torch.float64, device=dev), rope), dim=1)
        both = both.repeat_interleave(torch.tensor(counts, device=dev), dim=0, output_size=b * w)  # [B * W, 2, r]
        cos, sin = both.view(b, w, 2, -1).unbind(2)  # [B, W, r] each
        swap = cos.shape[2] == head_dim
    return DenseStep(b, t, w, slots, mask, qidx, back, cos, sin, swap, tuple(lens))


def _owns(rows: list, owns: list | None) -> list:
    """Each row's own slots as ``dense_step`` takes them: the given runs, else ``row.own``."""
    owns = owns if owns is not None else [None] * len(rows)
    return [r.own if o is None else o for r, o in zip(rows, owns)]


def _key_counts(segments: list, owns: list) -> tuple[list[list[int]], list[int]]:
    """Each row's shared segments' key counts and its own keys' count (``owns`` as ``_owns`` gives them)."""
    sizes = [[_count(s) for s, _, _ in segs] for segs in segments]
    return sizes, [sum(k for _, k in o) if isinstance(o, list) else o.shape[0] for o in owns]


def dense_steps(rows: list, segments: list[list[tuple[Slots, int, torch.Tensor | None]]], kv_heads: int,
                head_dim: int, rope: torch.Tensor | None, dev, most: int,
                owns: list[list[tuple[int, int]] | torch.Tensor] | None = None, spare: int = 0
                ) -> list[tuple[DenseStep, list[int]]] | None:
    """A step's rows as ``dense_step``s, each with the indices of its rows: one for them all where
    its padded scores fit ``most``; else the rows split into groups that each fit (``dense_groups``:
    decode rows together, prefill rows by their length), so a step that mixes 48 decode rows with a
    few prefill rows of a hundred queries is a few calls a layer, not one call padding every decode
    row to the longest prefill's queries, nor, past ``most``, thousands of per-part calls and merges
    (a RAG batch's admission steps on a GPU, eval/results/cuda_checks_2026-11-28b.md). None where a
    single row alone would exceed ``most`` (the caller keeps the per-part path, logged)."""
    ts = [len(r.ids) for r in rows]
    owns = _owns(rows, owns)
    sizes, n_own = _key_counts(segments, owns)
    lens = [sum(x) + o for x, o in zip(sizes, n_own)]
    groups = dense_groups(ts, [n + spare for n in lens], kv_heads, most)
    if groups is None:
        log.info("a step of %d rows (%d queries, %d keys at most a row): a row alone would pad more than %d "
                 "scores a layer: its attention runs part by part", len(rows), max(ts), max(lens), most)
        return None
    if len(groups) == 1:
        step = dense_step(rows, segments, kv_heads, head_dim, rope, dev, most, owns=owns, spare=spare)
        return [(step, groups[0])]
    log.debug("a step of %d rows (%d queries, %d keys at most a row) in %d padded calls a layer", len(rows),
              max(ts), max(lens), len(groups))
    return [(dense_step([rows[i] for i in g], [segments[i] for i in g], kv_heads, head_dim, rope, dev, most,
                        owns=[owns[i] for i in g]), g) for g in groups]


def dense_groups(queries: list[int], keys: list[int], kv_heads: int, most: int) -> list[list[int]] | None:
    """Row indices in groups whose padded scores (KV heads x rows x the group's most queries x its
    most keys) each stay within ``most``: every row in one group where that fits; else the decode
    rows (one query) first, then the others from the most queries down, each group closed where the
    next row would take it past ``most``. None where one row alone exceeds it."""
    n = len(queries)
    if kv_heads * n * max(queries) * max(keys) <= most:
        return [list(range(n))]
    order = [i for i in range(n) if queries[i] == 1] + sorted((i for i in range(n) if queries[i] > 1),
                                                              key=lambda i: -queries[i])
    groups: list[list[int]] = []
    group, t, w = [], 0, 0
    for i in order:
        if kv_heads * queries[i] * keys[i] > most:
            return None
        nt, nw = max(t, queries[i]), max(w, keys[i])
        if group and (kv_heads * (len(group) + 1) * nt * nw > most or (queries[i] > 1) != (t > 1)):
            groups.append(group)
            group, nt, nw = [], queries[i], keys[i]
        group.append(i)
        t, w = nt, nw
    groups.append(group)
    return groups


def rotation(shift: torch.Tensor, rope: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [K, r] (float32, angles in float64) rotating keys forward by ``shift`` [K] positions
    at the rotary frequencies ``rope`` [r / 2], in the rotate-half layout (channel c pairs with
    c + r / 2); sin's first half negated, so a rotation is k * cos + swap_halves(k) * sin."""
    angle = shift[:, None] * rope.to(shift.device, torch.float64)[None, :]  # [K, r / 2]
    c, s = angle.cos(), angle.sin()
    return torch.cat([c, c], dim=1).float(), torch.cat([-s, s], dim=1).float()


def rotate(k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, swap: bool) -> torch.Tensor:
    """Keys (or queries) k [..., K, D] float32 rotated by (cos, sin) [..., K, r] (``rotation``,
    broadcast against k) over their first r channels; ``swap``: r = D, the halves swapped by a roll
    of half the channels (one op, a plain copy: a gather of channels ran 20x slower on the CPU)."""
    d = k.shape[-1]
    r = cos.shape[-1]
    if swap:
        return torch.addcmul(k * cos, k.roll(d // 2, -1), sin)
    rot = k[..., :r]
    swapped = torch.cat([rot[..., r // 2:], rot[..., : r // 2]], dim=-1)
    return torch.cat([rot * cos + swapped * sin, k[..., r:]], dim=-1)


@dataclass(eq=False)
class _Work:
    """The buffers every layer of a step gathers its keys and values into and rotates its keys in,
    and their views, made once (``_work``): a layer's Python is then its tensor calls alone. A
    B = 48 step allocated and freed four tensors of 8 MB a layer on the CPU, whose frees and
    first touches made the layer's host time grow with B (eval/results/host_overhead.md)."""

    gathered: torch.Tensor  # [2, Hk, B * W, D] in the pool's dtype: ``index_select``'s out
    widened: torch.Tensor | None  # the same in float32 where the pool is not (else None)
    k: torch.Tensor  # [Hk, B, W, D] float32 keys as gathered (a view)
    v: torch.Tensor  # [Hk, B, W, D] float32 values (a view)
    rotated: torch.Tensor | None  # [Hk, B, W, D] float32 keys rotated (None: nothing shifted)
    # rotate-half of the first r channels: (to, from) pairs of views copied, then product and addcmul
    copies: tuple = ()
    head: tuple = ()  # (rotated[..., :r], k[..., :r], swapped [Hk, B, W, r])
    tail: tuple | None = None  # (rotated[..., r:], k[..., r:]) where r < D


def _work(step: DenseStep, kv: torch.Tensor, hk: int, d: int) -> _Work:
    """``step``'s buffers for one layer's pool buffer kv [2, Hk, S, D] (made at the first layer)."""
    key = (kv.dtype, kv.device, hk, d, torch.is_inference_mode_enabled())
    work = step.work.get(key)
    if work is not None:
        return work
    b, w = step.rows, step.width
    gathered = torch.empty((2, hk, b * w, d), dtype=kv.dtype, device=kv.device)
    widened = None if kv.dtype == torch.float32 else torch.empty(gathered.shape, dtype=torch.float32, device=kv.device)
    k, v = (gathered if widened is None else widened).view(2, hk, b, w, d).unbind(0)
    rotated, copies, head, tail = None, (), (), None
    if step.cos is not None:
        r = step.cos.shape[-1]
        h = r // 2
        rotated = torch.empty_like(k)
        swapped = torch.empty((hk, b, w, r), dtype=torch.float32, device=kv.device)
        copies = ((swapped[..., : r - h], k[..., h:r]), (swapped[..., r - h:], k[..., :h]))
        head = (rotated[..., :r], k[..., :r], swapped)
        tail = (rotated[..., r:], k[..., r:]) if r < d else None
    work = step.work[key] = _Work(gathered, widened, k, v, rotated, copies, head, tail)
    return work


def attend_dense(step: DenseStep, q: torch.Tensor, kv: torch.Tensor, scale: float,
                 lse: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Queries q [Hk, G, N, D] (float32) over the step's keys in one layer's pool buffer
    [2, Hk, S, D] (``KVPool.layers``): (out, log-sum-exp [Hk, G, N] or None), float32; ``out`` is
    [Hk, G, N, D], or, for a step of decode rows without ``lse``, [N, Hk * G, D] (the layout the
    model reads back). Without ``lse``: torch's fused attention (one call; on a GPU its
    memory-efficient kernel, which takes the bias); with it: the same softmax as matrix products.
    A decode step is ~11 ops a layer: one gather of keys and values, four to rotate the shifted
    keys (two copies swapping the halves, a product, an addcmul), the fused attention over views;
    the gather and the rotation write into buffers made at the step's first layer (``_work``),
    so a layer allocates and frees none of its keys."""
    hk, g, n, d = q.shape
    b, t, w = step.rows, step.queries, step.width
    # keys and values in one gather into the step's buffers: [Hk, B, W, D] each
    work = _work(step, kv, hk, d)
    torch.index_select(kv, 2, step.slots, out=work.gathered)
    if work.widened is not None:
        work.widened.copy_(work.gathered)
    k, v = work.k, work.v
    if work.rotated is not None:  # ``rotate`` into the buffers: k * cos + rotate_half(k) * sin
        for to, source in work.copies:
            to.copy_(source)
        out_head, k_head, swapped = work.head
        torch.mul(k_head, step.cos, out=out_head)
        out_head.addcmul_(swapped, step.sin)
        if work.tail is not None:
            work.tail[0].copy_(work.tail[1])
        k = work.rotated
    if t == 1 and not lse:  # decode rows: batched by (row, KV head), their G queries each, as views
        out = torch.nn.functional.scaled_dot_product_attention(
            q.permute(2, 0, 1, 3), k.transpose(0, 1), v.transpose(0, 1), attn_mask=step.mask, scale=scale)
        return out.reshape(b, hk * g, d), None  # [B, Hk, G, D] -> [N, Hq, D]
    if step.qidx is not None:
        q = q.index_select(2, step.qidx)
    q = q.view(hk, g, b, t, d).transpose(1, 2).reshape(hk, b, g * t, d)
    if not lse:
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=step.bias(hk, g), scale=scale)
    else:
        q = q.reshape(hk * b, g * t, d)
        s = torch.baddbmm(step.batched_bias(hk, g), q, k.reshape(hk * b, w, d).transpose(1, 2),
                          alpha=scale)  # [Hk * B, G * T, W]
        top = s.amax(dim=-1, keepdim=True)
        p = s.sub_(top).exp_()
        total = p.sum(dim=-1, keepdim=True)
        out = torch.bmm(p, v.reshape(hk * b, w, d)).div_(total)
    out = out.reshape(hk, b, g, t, d).transpose(1, 2).reshape(hk, g, b * t, d)
    if step.back is not None:
        out = out.index_select(2, step.back)
    if not lse:
        return out, None
    l = total.log_().add_(top).view(hk, b, g, t).transpose(1, 2).reshape(hk, g, b * t)
    return out, (l.index_select(2, step.back) if step.back is not None else l)


# -- a decode batch's step kept across steps ------------------------------------------------------
@dataclass(eq=False)
class _Kept:
    """What a kept row must match: the scheduler's objects (by identity), its block table's
    contents and its own tokens so far."""

    blocks: list[int]
    table: list[int]  # a copy of ``blocks``' contents
    shared: list
    runs: list | None
    shift: list[int] | None
    slots: list | None
    own: int  # own tokens (keys) of the row in the kept plan
    keys: int  # every key of the row in the kept plan (shared + own)


class DecodePlans:
    """The last decode step's plan of a pool (``KVPool.decode_plans``), reused and grown in place
    while its rows continue (``reuse``), replaced by the next one built (``keep``)."""

    def __init__(self, block_size: int):
        self.block_size = block_size
        self.plan = None  # the kept StepPlan (its ``dense`` is grown in place)
        self.mask = None  # its dense mask as one row of B * W (a view, made once a kept plan)
        self.rows: list[_Kept] = []
        self.scale = self.rope = self.most = None  # what the kept plan was built with
        self.reused = 0  # steps that reused the kept plan (grown or as it was)
        self.built = 0  # decode plans kept after a rebuild

    @staticmethod
    def keepable(rows: list) -> bool:
        """Rows a kept plan can follow: every row one token, no key limits, a block table."""
        return all(len(r.ids) == 1 and r.own_blocks is not None and r.shared_limits is None for r in rows)

    def forget(self) -> None:
        self.plan, self.mask, self.rows = None, None, []

    def keep(self, rows: list, plan, scale, rope, most: int) -> None:
        """Keep ``plan`` (built for ``rows``, with spare keys: ``dense_step(spare=SPARE_KEYS)``) for the
        next step; where ``rows`` are no decode batch (or no plan was built) the last one is forgotten."""
        step: DenseStep | None = plan.dense if plan is not None else None
        if step is None or not self.keepable(rows):
            self.forget()
            return
        lengths = step.lengths
        self.plan, self.scale, self.rope, self.most = plan, scale, rope, most
        with torch.inference_mode():
            self.mask = step.mask.view(-1)  # [B, 1, 1, W]: one query a row, key (i, j) at i * W + j
        self.rows = [_Kept(r.own_blocks, list(r.own_blocks), r.shared, r.shared_runs, r.shared_shift, r.shared_slots,
                           r.own_count, n) for r, n in zip(rows, lengths)]
        self.built += 1

    def reuse(self, rows: list, scale, rope, most: int):
        """The kept plan for ``rows`` (grown by one own key a row where they are one token further),
        or None where it does not fit them (the caller builds a new one and ``keep``s it). ``scale``,
        ``rope`` and ``most`` (``tunables.DENSE_MAX``): as the plan would be built."""
        plan = self.plan
        if plan is None or len(rows) != len(self.rows) or scale != self.scale or rope is not self.rope \
                or most != self.most:
            return None
        grow = None
        for r, k in zip(rows, self.rows):
            if len(r.ids) != 1 or r.own_blocks is not k.blocks or r.shared is not k.shared \
                    or r.shared_runs is not k.runs or r.shared_shift is not k.shift or r.shared_slots is not k.slots \
                    or r.shared_limits is not None or r.own_blocks != k.table:
                return None
            d = r.own_count - k.own
            if grow is None:
                grow = d
            if d != grow or d not in (0, 1):
                return None
        if grow:
            if not self._grow(plan.dense):
                return None
        self.reused += 1
        return plan

    def _grow(self, step: DenseStep) -> bool:
        """Each row's next own token appended to ``step`` in place: its slot, its key unmasked."""
        w, bs = step.width, self.block_size
        if any(k.keys >= w for k in self.rows):  # a row outgrew the spare keys: rebuild
            return False
        at, slot = [], []
        for i, k in enumerate(self.rows):
            at.append(i * w + k.keys)
            slot.append(k.blocks[k.own // bs] * bs + k.own % bs)  # own token k.own's slot (its block table)
        # (a step built inside inference mode, as ``paged_forward`` builds it, is updated in place only
        # there); one host tensor and two scatters whatever the rows: 12 aten events a step
        with torch.inference_mode():
            where = on_device([at, slot], step.slots.device)
            keys = where[0]
            step.slots.scatter_(0, keys, where[1])
            self.mask.scatter_(0, keys, 0.0)
        step.memo.clear()  # the biases derived from the mask
        for k in self.rows:
            k.own += 1
            k.keys += 1
        return True
