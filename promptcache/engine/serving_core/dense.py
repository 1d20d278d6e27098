"""One attention call a layer for a step's rows, their keys gathered from the KV pool by slot.

Without the native CPU kernel (the path a GPU takes: every op a kernel launch), reading each shared
segment and each earlier part of a row as its own attention call, each followed by a log-sum-exp
merge, cost dozens of ops per row and layer (eval/host_overhead.py). Here the step's metadata is
built once (``dense_step``) and every layer runs one padded attention over it (``attend_dense``):

  * each row's keys are its shared segments that live in the pool (``PagedRow.shared_slots``, or
    a view into the pool's buffer) followed by its own tokens, as one slot list padded to the
    step's longest: ``slots`` [B * W]; a layer gathers its keys and values with two
    ``index_select`` calls;
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

Softmax runs in float32 as matrix products (scores, max, exp, sum, product, divide), and the
log-sum-exp comes back too where segments held outside the pool (a store tier's tensors) are
still merged in afterwards by the caller. Attention that reads key positions beyond rotation
(ALiBi, sliding windows: ``paged.KeyRule``) keeps the per-part path.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

__all__ = ["DenseStep", "attend_dense", "dense_step", "pool_slots", "rotate", "rotation"]

log = logging.getLogger(__name__)


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
    cos: torch.Tensor | None = None  # [B * W, r] float32 rotation of each key (None: nothing shifted)
    sin: torch.Tensor | None = None  # [B * W, r] float32, signs folded in for the rotate-half form
    swap: bool = False  # the rotation covers every channel (r = D): halves swapped by a flip
    memo: dict = field(default_factory=dict)  # ``mask`` as ``bias`` and ``batched_bias`` give it

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


def pool_slots(buf: torch.Tensor, view: torch.Tensor) -> torch.Tensor | None:
    """The pool slots [n] a segment view [L, 2, Hk, n, D] reads, where it is a run of the pool's
    buffer ``buf`` [L, 2, Hk, S, D] (None: a tensor of its own, as a store tier's)."""
    if view.device != buf.device or view.untyped_storage().data_ptr() != buf.untyped_storage().data_ptr():
        return None
    if view.dim() != 5 or view.shape[:3] != buf.shape[:3] or view.shape[4] != buf.shape[4] \
            or view.stride() != buf.stride():
        return None
    start, rest = divmod(view.storage_offset() - buf.storage_offset(), buf.stride(3))
    if rest or start < 0 or start + view.shape[3] > buf.shape[3]:
        return None
    return torch.arange(start, start + view.shape[3], dtype=torch.long)


def dense_step(rows: list, segments: list[list[tuple[torch.Tensor, int, torch.Tensor | None]]], kv_heads: int,
               head_dim: int, rope: torch.Tensor | None, dev, most: int) -> DenseStep | None:
    """The metadata of a step of ``rows`` (``PagedRow``), ``segments[r]``: row r's shared segments
    read from the pool, in order, as (slots [n], shift, limits [t] or None). None where the padded
    scores of one query head a KV head would exceed ``most`` elements (the caller keeps the
    per-part path)."""
    b = len(rows)
    ts = [len(r.ids) for r in rows]
    # sizes as Python ints (``shape[0]``: ``len`` of a tensor costs a Python call)
    sizes = [[s.shape[0] for s, _, _ in segs] for segs in segments]
    owns = [r.own.shape[0] for r in rows]
    n_shared = [sum(x) for x in sizes]
    lens = [n + o for n, o in zip(n_shared, owns)]
    t, w = max(ts), max(lens)
    size = kv_heads * b * t * w
    if size > most:
        log.info("a step of %d rows (%d queries, %d keys at most a row) would pad %d scores a layer (more than %d): "
                 "its attention runs part by part", b, t, w, size, most)
        return None
    # one concatenation of every row's slots and its padding (slot 0, masked), on the pool's device
    pad = torch.zeros(w, dtype=torch.long, device=dev)
    pieces = []
    for r, segs, n in zip(rows, segments, lens):
        pieces += [s for s, _, _ in segs]
        pieces += [r.own, pad[: w - n]]
    slots = torch.cat([x if x.device == pad.device else x.to(dev) for x in pieces])  # [B * W]
    # the first query index of its row that sees each key: 0 for shared keys, done + i sees own key i;
    # nobody (t) sees padding
    shared, done, length = torch.tensor([n_shared, [o - n for o, n in zip(owns, ts)], lens],
                                        dtype=torch.long).to(dev)[:, :, None]
    j = torch.arange(w, device=dev)[None, :]
    first = torch.where(j < shared, 0, (j - shared - done).clamp(min=0)).masked_fill_(j >= length, t)
    sees = torch.arange(t, device=dev)[None, :, None] >= first[:, None, :]  # [B, T, W]
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
    mask = torch.zeros((b, 1, t, w), dtype=torch.float32, device=dev).masked_fill_(~sees[:, None], float("-inf"))
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
        cos, sin = rotation(torch.tensor(shifts, dtype=torch.float64), rope)  # a row per part, not per key
        counts = torch.tensor(counts, device=dev)
        cos = cos.to(dev).repeat_interleave(counts, dim=0, output_size=b * w)
        sin = sin.to(dev).repeat_interleave(counts, dim=0, output_size=b * w)
        swap = cos.shape[1] == head_dim
    return DenseStep(b, t, w, slots, mask, qidx, back, cos, sin, swap)


def rotation(shift: torch.Tensor, rope: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [K, r] (float32, angles in float64) rotating keys forward by ``shift`` [K] positions
    at the rotary frequencies ``rope`` [r / 2], in the rotate-half layout (channel c pairs with
    c + r / 2); sin's first half negated, so a rotation is k * cos + swap_halves(k) * sin."""
    angle = shift[:, None] * rope.to(shift.device, torch.float64)[None, :]  # [K, r / 2]
    c, s = angle.cos(), angle.sin()
    return torch.cat([c, c], dim=1).float(), torch.cat([-s, s], dim=1).float()


def rotate(k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, swap: bool) -> torch.Tensor:
    """Keys (or queries) k [..., K, D] float32 rotated by (cos, sin) [K, r] (``rotation``) over their
    first r channels; ``swap``: r = D, the halves swapped as a flip of a [.., 2, D / 2] view (fewer
    ops than slices and a cat, and a plain copy: a gather of channels ran 20x slower on the CPU)."""
    d = k.shape[-1]
    r = cos.shape[1]
    if swap:
        return torch.addcmul(k * cos, k.unflatten(-1, (2, d // 2)).flip(-2).flatten(-2), sin)
    rot = k[..., :r]
    swapped = torch.cat([rot[..., r // 2:], rot[..., : r // 2]], dim=-1)
    return torch.cat([rot * cos + swapped * sin, k[..., r:]], dim=-1)


def attend_dense(step: DenseStep, q: torch.Tensor, kbuf: torch.Tensor, vbuf: torch.Tensor, scale: float,
                 lse: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Queries q [Hk, G, N, D] (float32) over the step's keys in one layer's pool buffers
    [Hk, S, D]: (out, log-sum-exp [Hk, G, N] or None), float32; ``out`` is [Hk, G, N, D], or, for a
    step of decode rows without ``lse``, [N, Hk * G, D] (the layout the model reads back).
    Without ``lse``: torch's fused attention (one call; on a GPU its memory-efficient kernel, which
    takes the bias); with it: the same softmax as matrix products."""
    hk, g, n, d = q.shape
    b, t, w = step.rows, step.queries, step.width
    k = kbuf[:, step.slots]  # [Hk, B * W, D] (indexing: twice index_select's speed here on the CPU)
    v = vbuf[:, step.slots]
    if k.dtype != torch.float32:
        k, v = k.float(), v.float()
    if step.cos is not None:
        k = rotate(k, step.cos, step.sin, step.swap)
    if t == 1 and not lse:  # decode rows: batched by (row, KV head), their G queries each, as views
        out = torch.nn.functional.scaled_dot_product_attention(
            q.permute(2, 0, 1, 3), k.view(hk, b, w, d).transpose(0, 1), v.view(hk, b, w, d).transpose(0, 1),
            attn_mask=step.mask, scale=scale)  # [B, Hk, G, D]
        return out.reshape(b, hk * g, d), None
    if step.qidx is not None:
        q = q.index_select(2, step.qidx)
    q = q.view(hk, g, b, t, d).transpose(1, 2).reshape(hk, b, g * t, d)
    if not lse:
        out = torch.nn.functional.scaled_dot_product_attention(
            q, k.view(hk, b, w, d), v.view(hk, b, w, d), attn_mask=step.bias(hk, g), scale=scale)
    else:
        q = q.reshape(hk * b, g * t, d)
        s = torch.baddbmm(step.batched_bias(hk, g), q, k.view(hk * b, w, d).transpose(1, 2),
                          alpha=scale)  # [Hk * B, G * T, W]
        top = s.amax(dim=-1, keepdim=True)
        p = s.sub_(top).exp_()
        total = p.sum(dim=-1, keepdim=True)
        out = torch.bmm(p, v.view(hk * b, w, d)).div_(total)
    out = out.reshape(hk, b, g, t, d).transpose(1, 2).reshape(hk, g, b * t, d)
    if step.back is not None:
        out = out.index_select(2, step.back)
    if not lse:
        return out, None
    l = total.log_().add_(top).view(hk, b, g, t).transpose(1, 2).reshape(hk, g, b * t)
    return out, (l.index_select(2, step.back) if step.back is not None else l)
