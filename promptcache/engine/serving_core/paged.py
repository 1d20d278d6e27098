"""One packed forward over several requests whose states live in a ``KVPool``, read in place.

A step packs every scheduled request's new tokens into one sequence ``[1, N]`` (decode rows one
token each, prefill chunks several) and runs the stock model once. Attention goes through a
function registered with transformers' ``AttentionInterface`` (``"promptcache_paged"``, set with
``Adapter.attention_as`` for this forward only, under the runner's lock): the model computes queries,
rotates them at our position IDs, hands new keys/values to ``PagedCache.update`` (which writes
them into the requests' own pool slots) and calls the function, which attends each request's
queries to:

  * its **shared segments**: stored states read in place ([L, 2, H, n, D] views: pool runs or a
    store tier's own tensors). A segment several requests share is read ONCE for all of them
    (their queries stacked into one matrix product: cascade attention); and
  * its **own tokens** (earlier chunks, generated tokens and this step's tokens, causal among
    the new ones), from its pool slots. Decode rows are batched: their own keys (a few dozen
    per request) are gathered into one padded tensor, the only copy on the hot path (none with
    the native CPU kernel, which reads them by slot). With the native kernel a decode row reads
    its shared segments with its own tokens too, as runs of one slot list (pool runs, or a store
    tier's tensors read in place; a segment read shifted with the row's query rotated back once
    per run: ``decode_runs.py``): every decode row of a step in one call a layer. Prefill rows
    (chunks, selective recompute's rows with key limits) read their segments and own tokens the
    same way in one more call (``attend_prefill_runs``: each query sees a prefix of each run).

Without the native CPU kernel (turned off, or a GPU: the path where every op is a kernel launch)
a step of rotary or learned-position rows is attended in ONE call a layer instead (``dense.py``:
each row's pool-held segments and own tokens gathered by slot, one mask built once a step; a step
too large to pad in one call is attended a group of rows a call, decode rows apart from prefills);
the scheduler puts the documents it would read from a store's tensors into the pool on that path
(``ServingScheduler.pools_documents``), and segments still outside the pool are merged into it
as below. A decode batch as the last step left it takes its input ids from the last step's argmax
on the device (``PagedRow.sampled``), not from the host.

Partial results are merged by log-sum-exp in float32, which is exact algebra: the result equals
attention over the concatenated keys up to float rounding. A step of decode rows only (the steady
state of serving) takes a shorter path with the same algebra (``_attend_decodes``). On a CPU the
attention calls run in the native kernel (``cpu_attention``: faster than torch's fused kernel here),
which also reads decode rows' own keys from their slots without the gather; without it, from
``tunables.DECODE_MATMUL_ROWS`` rows on, the rows' own tokens go through matrix products instead
of torch's fused kernel. Segments keep their position IDs (the
keys were rotated when they were computed), so Prompt Cache's gaps, unions and parameters need
nothing here.

Attention that reads key positions (``KeyRule``, from the adapter) takes its own path
(``_attend_keyed``): ALiBi families add a bias per key position and head (each family's slopes
and rounding: ``Adapter.paged_bias``), and sliding windows hide keys at positions <= p - window
from a query at position p (transformers' ``kv_idx > q_idx - window``, measured here in position
IDs: the same at contiguous positions; with Prompt Cache's gaps, a gap counts as distance). The
plan then carries the position IDs of the step's queries, shared segments (``PagedRow.shared_pos``:
the pool's and the store's positions) and own tokens (``PagedRow.own_pos``); each partial result
is computed with its bias (torch's kernels: the native one takes no bias), a partial the window
hides from every query is skipped, and the merge stays exact because the bias depends only on
the key's position and head. A window no row reaches past leaves the plan as it is without one.
ALiBi families and Falcon compute attention inline, not through the attention interface; their
adapters route it here for the paged forward only (``Adapter.paged_attention``, used by
``attention_swapped``). ``paged_refusal`` refuses a model whose paged forward fails its
self-check against the stock forward; the engine then refuses the model (``core.Engine``).
"""

from __future__ import annotations

import itertools
import math
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable

import torch
from transformers import AttentionInterface
from transformers.cache_utils import Cache, CacheLayerMixin
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from ...models.relocate import rope_spec
from ...models.splice import SpliceCache
from ... import tunables
from ...tunables import DECODE_MATMUL_ROWS, FOLD_PREFILL, FOLD_SHARED, GATHER_MAX, SEGMENTS_MAX  # read at call time (tests set them here)
from ...kernels import attention as cpu_attention
from .decode_runs import DecodeRuns, PrefillRuns, RunTable
from .dense import SPARE_KEYS, DenseStep, attend_dense, dense_steps, on_device, pool_run, rotate, rotation
from .kvpool import KVPool

__all__ = ["KeyRule", "PagedRow", "StepPlan", "attend", "attention_swapped", "build_plan", "key_rule", "paged_forward",
           "paged_refusal", "query_rope", "step_ids", "step_inputs", "step_places", "write_kv", "ATTENTION_NAME"]

ATTENTION_NAME = "promptcache_paged"


@dataclass(eq=False)
class PagedRow:
    """One request's part of a step: ``ids``/``pos`` its t new tokens; ``shared``: (key, view
    [L, 2, H, n, D]) segments it reads before its own tokens; ``own``: pool slots of its own
    tokens so far INCLUDING these t (the last t are written by this step), the first ``own_count``
    of ``own_slots``; ``logits``: whether the step returns logits of its last token.

    ``own_slots`` may run past the row's tokens (the scheduler gives a request's whole slot table,
    ``own_count`` its tokens so far): ``own`` is then a view made on its first read, so a decode
    step whose plan reads only the count and the block table (``dense.DecodePlans``) makes no
    tensor op a row."""

    ids: list[int]
    pos: list[int]
    shared: list[tuple[str, torch.Tensor]]
    own_slots: torch.Tensor  # LongTensor [>= own_count] of pool slots, the row's own tokens' first
    logits: bool = True
    # key positions, read only where attention depends on them (``KeyRule``: ALiBi, sliding windows):
    shared_pos: list[torch.Tensor] | None = None  # position IDs [n] of each shared segment, as ``shared``
    own_pos: list[int] | None = None  # position IDs of the own tokens (None: just ``pos``, nothing earlier)
    # pool slots [n] of each shared segment held in the pool (None: a store tensor read in place); a
    # decode row read by the native gather op reads such segments with its own slots (FOLD_SHARED)
    shared_slots: list[torch.Tensor | None] | None = None
    # key limits in prompt order (selective recompute's rows): per shared segment, the number of its
    # leading keys each of the t queries sees (LongTensor [t], 0 .. n), or None where every query
    # sees all of it; a row with any limit is read as a prefill chunk (never folded into a gather)
    shared_limits: list[torch.Tensor | None] | None = None
    # per shared segment, the positions its stored states lie behind the positions it is read at
    # (``Segment.shift``: a document read in place at any position; 0: where it was encoded)
    shared_shift: list[int] | None = None
    # per shared segment, its run of pool slots (first, count), or None outside the pool: where
    # ``shared_slots`` hold ascending runs, the same as Python ints (the scheduler computes them once
    # a request; None: read from each view's metadata every step, ``dense.pool_run``)
    shared_runs: list[tuple[int, int] | None] | None = None
    # the pool blocks holding ``own``'s slots, in token order (a block table: ``own`` is slots 0 ..
    # len(own) - 1 of these blocks), or None: a step then builds its slot lists from these Python
    # ints in one tensor a step (``KVPool.slot_runs``) instead of concatenating a tensor a row
    own_blocks: list[int] | None = None
    # the last step's sampled ids [B] kept on the device, where this step's rows are exactly the B rows
    # that sampled them, in order, each one token (a decode batch as the last step left it: the
    # scheduler's ``_sampled``); the step's input ids are then this tensor itself, not ``ids`` copied in
    sampled: torch.Tensor | None = None
    # its own tokens so far, these t included (None at construction: every one of ``own_slots``)
    own_count: int | None = None
    _own: torch.Tensor | None = field(default=None, init=False, repr=False)

    def __post_init__(self):
        total = self.own_slots.shape[0]
        if self.own_count is None:
            self.own_count = total
        elif not len(self.ids) <= self.own_count <= total:
            raise ValueError(f"a paged row of {len(self.ids)} new tokens counts {self.own_count} own tokens "
                             f"over {total} own slots (it needs {len(self.ids)} to {total})")

    @property
    def own(self) -> torch.Tensor:
        """Pool slots [own_count] of its own tokens so far, these t included (a view, made once)."""
        if self._own is None:
            slots = self.own_slots
            self._own = slots if self.own_count == slots.shape[0] else slots[: self.own_count]
        return self._own

    def limits(self) -> list[torch.Tensor | None]:
        return self.shared_limits if self.shared_limits is not None else [None] * len(self.shared)

    def shifts(self) -> list[int]:
        return self.shared_shift if self.shared_shift is not None else [0] * len(self.shared)


@dataclass(frozen=True)
class KeyRule:
    """What a model's attention reads from key position IDs besides the keys: an additive ALiBi
    bias (``bias(positions [n]) -> [Hq, n]`` float32, added to the scaled scores) and sliding
    windows per layer (``windows[layer]``: a query at position p sees keys at positions
    > p - window; None: every key). None of either: the plan carries no positions."""

    bias: Callable[[torch.Tensor], torch.Tensor] | None = None
    windows: tuple[int | None, ...] | None = None

    def window(self, layer: int) -> int | None:
        return None if self.windows is None else self.windows[layer]


def key_rule(adapter) -> KeyRule | None:
    """The adapter's ``KeyRule`` (None: attention reads no positions: rotary and learned models
    without a sliding window)."""
    bias = adapter.paged_bias if adapter.positional == "alibi" else None
    windows = adapter.sliding_windows()
    windows = tuple(windows) if windows is not None and any(w is not None for w in windows) else None
    return KeyRule(bias, windows) if bias is not None or windows is not None else None


@dataclass
class StepPlan:
    """Per-step index structures, built once and read by every layer."""

    pool: KVPool
    scale: float | None
    # (views read together, query idx [m]): one view, or several concatenated per layer
    segments: list[tuple[list[torch.Tensor], torch.Tensor]] = field(default_factory=list)
    decode_q: torch.Tensor | None = None  # [B] packed query index of each decode row
    decode_slots: torch.Tensor | None = None  # [B, K] own slots (padded)
    decode_lengths: torch.Tensor | None = None  # [B] own slots of each row (the rest is padding)
    # decode rows whose folded segments are read shifted or from a store's tensors (the native gather
    # op over runs; ``decode_runs.py``): None where every folded key is the pool's, read as it is
    decode_runs: DecodeRuns | None = None
    # prefill rows over runs (the native ``attend_prefill_runs``: ``decode_runs.PrefillRuns``): their
    # folded segments and own tokens, each query seeing a prefix of each run; None: none folded
    prefill_runs: PrefillRuns | None = None
    decode_bias: torch.Tensor | None = None  # [Hk * B, 1, K] float32: 0 where valid, -inf at padding (every layer's)
    decode_kpos: torch.Tensor | None = None  # [B, K] (host) position IDs of decode_slots, -1 at padding (KeyRule)
    # prefill chunks (q0, q1, new, earlier): query rows [q0, q1), the pool slots of the chunk's own
    # tokens (``new``) and of the row's earlier own tokens (``earlier``: parts read one by one),
    # each part a slice (an ascending run, read in place) or a LongTensor (gathered)
    prefills: list[tuple[int, int, slice | torch.Tensor, list[slice | torch.Tensor]]] = field(default_factory=list)
    # every row a decode row and every segment read by every query: ``_attend_decodes`` (fewer ops)
    decodes_only: bool = False
    # with a KeyRule (``_attend_keyed``): position IDs (host) of the step's queries [N], of each
    # segment group's keys and of each prefill's (new, earlier parts) keys
    keys: KeyRule | None = None
    qpos: torch.Tensor | None = None
    segment_pos: list[torch.Tensor] = field(default_factory=list)
    prefill_pos: list[tuple[torch.Tensor, list[torch.Tensor]]] = field(default_factory=list)
    # segments some queries see only a prefix of (``PagedRow.shared_limits``): (view, query idx
    # [m], keys seen by each [m], 1 .. n), read apart (never cascaded or concatenated); with a
    # KeyRule, their key positions in ``limited_pos``
    limited: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = field(default_factory=list)
    limited_pos: list[torch.Tensor] = field(default_factory=list)
    # segments read shifted (``PagedRow.shared_shift``): the rotary frequencies [r / 2] of the model
    # and, per entry of ``segments`` / ``limited``, each query's shift [m] (None: none shifted)
    rope: torch.Tensor | None = None
    segment_shift: list[torch.Tensor | None] = field(default_factory=list)
    limited_shift: list[torch.Tensor | None] = field(default_factory=list)
    # without the native kernel: every row's keys held in the pool in one call a layer (``dense.py``);
    # ``segments`` and ``limited`` then hold only segments outside the pool, merged in after it
    dense: DenseStep | None = None
    # the same split in groups where one padded call would exceed ``tunables.DENSE_MAX`` (``dense.dense_steps``):
    # each group's step and its queries' packed indices [n_g]; ``dense`` is then None
    dense_parts: list[tuple[DenseStep, torch.Tensor]] = field(default_factory=list)
    # built at the first layer, read by the others: (partial, window) -> (bias, dead queries);
    # ("rows", segment) -> the segment's queries as a slice or an index tensor
    memo: dict = field(default_factory=dict)


def build_plan(pool: KVPool, rows: list[PagedRow], scale: float | None = None, keys: KeyRule | None = None,
               rope: torch.Tensor | None = None) -> StepPlan:
    """``keys``: the model's ``KeyRule`` (``key_rule``); a sliding window that no row's keys
    reach past is dropped (the plan is then the one without it). ``rope``: the rotary
    frequencies queries are rotated by for segments read shifted (``query_rope``; None: shifts
    need no rotation, as with ALiBi, where ``shared_pos`` carries the positions)."""
    if keys is not None and keys.bias is None and not _window_bites(rows, min(w for w in keys.windows if w)):
        keys = None
    if keys is not None:
        return _shifted(_build_keyed(pool, rows, scale, keys), rope)
    if not cpu_attention.gathers(pool.buf):  # no native kernel (a GPU): one attention call a layer
        plan = _dense_plan(pool, rows, scale, rope)
        if plan is not None:
            return plan
    plan, dev = StepPlan(pool, scale), pool.buf.device
    by_key: dict[tuple, tuple[torch.Tensor, list[int], list[int]]] = {}
    decodes, off = [], 0
    # the native gather op reads each decode row's own slots in place up to its length: every decode
    # row goes through it (one call a layer); the fallback gathers copies padded to the longest row
    gather_max = None if cpu_attention.gathers(pool.buf) else GATHER_MAX
    table = RunTable(pool.buf)  # decode rows' shared segments folded into their slot lists, as runs
    ptable = RunTable(pool.buf, merge=False)  # prefill rows' segments and own tokens, a run each
    for row in rows:
        t = len(row.ids)
        limits, shifts = row.limits(), row.shifts()
        decode = t == 1 and (gather_max is None or row.own_count <= gather_max) and all(x is None for x in limits)
        fold = gather_max is None and (FOLD_SHARED if decode else FOLD_PREFILL)
        folded: list[torch.Tensor | None] = []  # a prefill row's key limits of each folded segment
        into = table if decode else ptable
        given = row.shared_slots if row.shared_slots is not None else [None] * len(row.shared)
        for i, (key, view) in enumerate(row.shared):
            # a row reads its segments with its own tokens (one softmax): pool segments by slot,
            # store tensors in place; a shifted one where its queries can be rotated (rotary models:
            # the gather ops rotate the row's queries once per run of keys at one shift)
            if fold and (not shifts[i] or rope is not None):
                lim = None if decode or limits[i] is None else _checked_limits(limits[i], view.shape[3], t)
                if given[i] is not None:
                    into.pool(given[i], shifts[i])
                    folded.append(lim)
                    continue
                if into.view(view, shifts[i]):
                    folded.append(lim)
                    continue
            if limits[i] is not None:
                _add_limited(plan, view, off, limits[i], None, shifts[i])
                continue
            entry = by_key.setdefault(key, (view, [], []))
            entry[1].extend(range(off, off + t))
            entry[2].extend([shifts[i]] * t)
        if decode:
            decodes.append((off, table.own(row.own)))
        elif folded:  # a prefill row over runs: its folded segments and own tokens in one native call a layer
            ptable.prefill(row.own, off, t, folded)
        else:  # a chunk reading no document (the causal call's packed tiles and bfloat16 products: a long
            # prompt's prefill 6-15% faster than over runs), or a decode row with a long own part
            done = row.own_count - t
            plan.prefills.append((off, off + t, _parts(row.own[done:], 1)[0], _parts(row.own[:done], SEGMENTS_MAX)))
        off += t
    grouped = _group_segments([(v, q, None, sh) for v, q, sh in by_key.values()], dev)
    plan.segments = [(views, idx) for views, idx, _, _ in grouped]
    plan.segment_shift = [sh for _, _, _, sh in grouped]
    if decodes:
        width = max(len(s) for _, s in decodes)
        slots = torch.zeros((len(decodes), width), dtype=torch.long, device=dev)
        for i, (_, s) in enumerate(decodes):
            slots[i, : len(s)] = s
        plan.decode_q = torch.tensor([q for q, _ in decodes], dtype=torch.long, device=dev)
        plan.decode_slots = slots
        plan.decode_lengths = torch.tensor([len(s) for _, s in decodes], dtype=torch.long, device=dev)
        if table.used:  # some run is shifted or lies in a store tensor: the gather op over runs
            plan.decode_runs = table.build(plan.decode_lengths.tolist())
        if gather_max is not None:  # the padded-copy fallback masks each row's padding; the native op reads lengths
            valid = torch.arange(width, device=dev)[None, :] < plan.decode_lengths[:, None]  # [B, width]
            hk, b = pool.buf.shape[2], len(decodes)
            plan.decode_bias = _bias(valid[None, :, None, :].expand(hk, b, 1, width).reshape(hk * b, 1, width))
        plan.decodes_only = not plan.prefills and not ptable.rows \
            and all(idx.numel() == off for _, idx in plan.segments) and all(sh is None for sh in plan.segment_shift)
    if ptable.rows:
        plan.prefill_runs = ptable.prefills()
    return _shifted(plan, rope)


def _checked_limits(limits: torch.Tensor, n: int, t: int) -> torch.Tensor:
    """A prefill row's key limits [t] of a segment of ``n`` keys, checked (0 .. n each)."""
    limits = limits.to("cpu", torch.long)
    if limits.shape != (t,) or bool((limits < 0).any()) or bool((limits > n).any()):
        raise ValueError(f"key limits of a shared segment of {n} tokens must be {t} values (one per query) in 0..{n}, "
                         f"got {limits.tolist()}")
    return limits


def _dense_plan(pool: KVPool, rows: list[PagedRow], scale: float | None, rope: torch.Tensor | None
                ) -> StepPlan | None:
    """``_build_dense``'s plan, or the last decode step's grown by a key a row where these rows
    are its requests one token further (``dense.DecodePlans``: a decode plan is built with spare keys
    and kept for the next step)."""
    kept = pool.decode_plans
    plan = kept.reuse(rows, scale, rope, tunables.DENSE_MAX)
    if plan is not None:
        return plan
    plan = _build_dense(pool, rows, scale, rope, spare=SPARE_KEYS if kept.keepable(rows) else 0)
    kept.keep(rows, plan, scale, rope, tunables.DENSE_MAX)  # (forgets the last one where rows are no decode batch)
    return plan


def _build_dense(pool: KVPool, rows: list[PagedRow], scale: float | None, rope: torch.Tensor | None,
                 spare: int = 0) -> StepPlan | None:
    """The plan of ``_attend_pooled``: each row's shared segments held in the pool and its own
    tokens as one ``DenseStep``; segments outside the pool (a store tier's tensors) stay cascade
    segments merged in after it; ``spare`` padded keys a row (``dense_step``). None where the step
    is too large to pad (``tunables.DENSE_MAX``)."""
    plan, dev = StepPlan(pool, scale), pool.buf.device
    by_key: dict[str, tuple[torch.Tensor, list[int], list[int]]] = {}
    in_pool, owns, off = [], [], 0
    for row in rows:
        t = len(row.ids)
        given = row.shared_slots if row.shared_slots is not None else [None] * len(row.shared)
        runs = row.shared_runs if row.shared_runs is not None else [None] * len(row.shared)
        mine = []
        for (key, view), slots, run, limits, shift in zip(row.shared, given, runs, row.limits(), row.shifts()):
            run = run if run is not None else pool_run(pool.buf, view)  # from the view's metadata: no tensor op
            slots = run if run is not None else slots
            if slots is not None:
                mine.append((slots, shift, limits))
            elif limits is not None:
                _add_limited(plan, view, off, limits, None, shift)
            else:
                entry = by_key.setdefault(key, (view, [], []))
                entry[1].extend(range(off, off + t))
                entry[2].extend([shift] * t)
        in_pool.append(mine)
        owns.append(None if row.own_blocks is None else pool.slot_runs(row.own_blocks, row.own_count))
        off += t
    steps = dense_steps(rows, in_pool, pool.buf.shape[2], pool.buf.shape[4], rope, dev, tunables.DENSE_MAX,
                        owns=owns, spare=spare)
    if steps is None:
        return None
    if len(steps) == 1:
        plan.dense = steps[0][0]
    else:  # each group's packed queries: the rows' own, in step order
        starts = list(itertools.accumulate((len(r.ids) for r in rows), initial=0))
        plan.dense_parts = [(step, torch.tensor([q for i in group for q in range(starts[i], starts[i + 1])],
                                                dtype=torch.long, device=dev)) for step, group in steps]
    grouped = _group_segments([(v, q, None, sh) for v, q, sh in by_key.values()], dev)
    plan.segments = [(views, idx) for views, idx, _, _ in grouped]
    plan.segment_shift = [sh for _, _, _, sh in grouped]
    return _shifted(plan, rope)


def _shifted(plan: StepPlan, rope: torch.Tensor | None) -> StepPlan:
    """The plan with the rotary frequencies its shifted segments need (kept only where a segment is shifted)."""
    if any(sh is not None for sh in plan.segment_shift + plan.limited_shift) \
            or (plan.decode_runs is not None and plan.decode_runs.shifts.numel()) \
            or (plan.prefill_runs is not None and plan.prefill_runs.runs.shifts.numel()):
        plan.rope = rope
    return plan


def _add_limited(plan: StepPlan, view: torch.Tensor, off: int, limits: torch.Tensor, pos: torch.Tensor | None,
                 shift: int = 0) -> None:
    """A segment the row's queries (packed from ``off``) see a prefix of, ``limits`` [t] keys each;
    queries that see none of it are left out."""
    n = view.shape[3]
    limits = limits.to("cpu", torch.long)
    if bool((limits < 0).any()) or bool((limits > n).any()):
        raise ValueError(f"key limits of a shared segment of {n} tokens must lie in 0..{n}, got {limits.tolist()}")
    sees = torch.nonzero(limits > 0).flatten()
    if sees.numel() == 0:
        return
    plan.limited.append((view, (sees + off).to(plan.pool.buf.device), limits[sees]))
    plan.limited_shift.append(torch.full((sees.numel(),), shift, dtype=torch.long) if shift else None)
    if pos is not None:
        plan.limited_pos.append(pos)


def _own_positions(row: PagedRow) -> list[int]:
    if row.own_pos is not None:
        if len(row.own_pos) != row.own_count:
            raise ValueError(f"a paged row has {row.own_count} own slots and {len(row.own_pos)} own positions")
        return list(row.own_pos)
    if row.own_count != len(row.ids):
        raise ValueError("this model's attention reads key positions: a paged row with earlier own tokens needs "
                         "their positions (PagedRow.own_pos)")
    return list(row.pos)


def _shared_positions(row: PagedRow) -> list[torch.Tensor]:
    if not row.shared:
        return []
    if row.shared_pos is None or len(row.shared_pos) != len(row.shared):
        raise ValueError("this model's attention reads key positions: a paged row's shared segments need their "
                         "position IDs (PagedRow.shared_pos, one per segment)")
    for (key, view), pos in zip(row.shared, row.shared_pos):
        if len(pos) != view.shape[3]:
            raise ValueError(f"shared segment {key} holds {view.shape[3]} tokens and {len(pos)} positions")
    return [p.detach().to("cpu", torch.long) for p in row.shared_pos]


def _window_bites(rows: list[PagedRow], window: int) -> bool:
    """Whether some row's query is ``window`` or more positions past one of its keys."""
    for row in rows:
        lows = [min(_own_positions(row))] + [int(p.min()) for p in _shared_positions(row) if len(p)]
        if max(row.pos) - min(lows) >= window:
            return True
    return False


def _build_keyed(pool: KVPool, rows: list[PagedRow], scale: float | None, keys: KeyRule) -> StepPlan:
    """The plan of ``_attend_keyed``: decode rows' own tokens gathered together (as in
    ``build_plan``), other rows' own tokens as prefills, shared segments grouped by the queries
    that read them; the position IDs of all of them alongside."""
    plan, dev = StepPlan(pool, scale, keys=keys), pool.buf.device
    by_key: dict[str, tuple[torch.Tensor, list[int], torch.Tensor, list[int]]] = {}
    decodes, off = [], 0
    for row in rows:
        t = len(row.ids)
        limits = row.limits()
        for (key, view), pos, lim, shift in zip(row.shared, _shared_positions(row), limits, row.shifts()):
            if lim is not None:
                _add_limited(plan, view, off, lim, pos, shift)
                continue
            # a segment read at another position is another partial here (its key positions differ)
            entry = by_key.setdefault((key, int(pos[0]) if len(pos) else 0), (view, [], pos, []))
            entry[1].extend(range(off, off + t))
            entry[3].extend([shift] * t)
        own_pos = torch.tensor(_own_positions(row), dtype=torch.long)
        if t == 1 and row.own_count <= GATHER_MAX and all(x is None for x in limits):
            decodes.append((off, row.own, own_pos))
            off += 1
            continue
        done = row.own_count - t
        earlier = _parts_at(row.own[:done], SEGMENTS_MAX)
        plan.prefills.append((off, off + t, _parts(row.own[done:], 1)[0], [p for p, _, _ in earlier]))
        plan.prefill_pos.append((own_pos[done:], [own_pos[a:b] for _, a, b in earlier]))
        off += t
    plan.qpos = torch.tensor([p for r in rows for p in r.pos], dtype=torch.long)
    grouped = _group_segments(list(by_key.values()), dev)
    plan.segments = [(views, idx) for views, idx, _, _ in grouped]
    plan.segment_pos = [pos for _, _, pos, _ in grouped]
    plan.segment_shift = [sh for _, _, _, sh in grouped]
    if decodes:
        width = max(len(s) for _, s, _ in decodes)
        slots = torch.zeros((len(decodes), width), dtype=torch.long, device=dev)
        plan.decode_kpos = torch.full((len(decodes), width), -1, dtype=torch.long)  # -1: padding
        for i, (_, s, pos) in enumerate(decodes):
            slots[i, : len(s)] = s
            plan.decode_kpos[i, : len(s)] = pos
        plan.decode_q = torch.tensor([q for q, _, _ in decodes], dtype=torch.long, device=dev)
        plan.decode_slots = slots
    return plan


def _decode_bias(plan: StepPlan, hk: int, g: int, window: int | None, dev) -> torch.Tensor:
    """The bias [Hk * B, G or 1, K] of decode rows over their gathered own keys: -inf at padding
    and behind the window, plus the ALiBi term of each key."""
    kpos, qpos = plan.decode_kpos, plan.qpos[plan.decode_q.cpu()]  # [B, K], [B]
    b, width = kpos.shape
    seen = kpos >= 0
    if window is not None:
        seen &= kpos > qpos[:, None] - window
    bias = _bias(seen.to(dev))[None, :, None, :]  # [1, B, 1, K]
    if plan.keys.bias is not None:
        alibi = plan.keys.bias(kpos.clamp(min=0).view(-1).to(dev)).float().view(hk, g, b, width)
        bias = bias + alibi.transpose(1, 2)  # [Hk, B, G, K]
    return bias.expand(hk, b, bias.shape[2], width).reshape(hk * b, bias.shape[2], width)


def _group_segments(segs: list[tuple[torch.Tensor, list[int], torch.Tensor | None, list[int]]], dev
                    ) -> list[tuple[list[torch.Tensor], torch.Tensor, torch.Tensor | None, torch.Tensor | None]]:
    """Segments (view, query indices, key positions or None, each query's shift) read by the same
    queries with the same shifts: kept apart while there are at most ``SEGMENTS_MAX`` of them,
    else read together (concatenated a layer at a time). Returns (views, query idx, their key
    positions concatenated or None, each query's shift [m] or None where none is shifted)."""
    by_queries: dict[tuple, list[tuple[torch.Tensor, torch.Tensor | None]]] = {}
    for view, q, pos, shifts in segs:
        by_queries.setdefault((tuple(q), tuple(shifts)), []).append((view, pos))
    out = []
    for (q, shifts), group in by_queries.items():
        idx = torch.tensor(q, dtype=torch.long, device=dev)
        shift = torch.tensor(shifts, dtype=torch.long) if any(shifts) else None
        if len(group) <= SEGMENTS_MAX:
            out += [([v], idx, pos, shift) for v, pos in group]
        else:
            pos = None if group[0][1] is None else torch.cat([p for _, p in group])
            out.append(([v for v, _ in group], idx, pos, shift))
    return out


def _merge(out, lse, idx, o, l) -> None:
    """Fold a partial result (o [Hk, G, m, D], lse l [Hk, G, m]) for queries ``idx`` (an index
    tensor, or a slice: consecutive queries, merged in place through views) into the running
    (out [Hk, G, N, D], lse [Hk, G, N]), all float32."""
    if isinstance(idx, slice):
        _merge_all(out[:, :, idx], lse[:, :, idx], o, l)
        return
    old = lse[:, :, idx]
    new = torch.logaddexp(old, l)
    out[:, :, idx] = out[:, :, idx] * torch.exp(old - new)[..., None] + o * torch.exp(l - new)[..., None]
    lse[:, :, idx] = new


def _merge_all(out, lse, o, l) -> None:
    """``_merge`` for a partial result over every query: in place, no gathers."""
    new = torch.logaddexp(lse, l)
    out.mul_(torch.exp(lse - new)[..., None]).add_(o * torch.exp(l - new)[..., None])
    lse.copy_(new)


def _bias(mask: torch.Tensor) -> torch.Tensor:
    """An additive float32 bias from a bool mask (True = attend): 0 there, -inf elsewhere."""
    return torch.zeros(mask.shape, dtype=torch.float32, device=mask.device).masked_fill_(~mask, float("-inf"))


def _attend(q, k, v, bias=None, scale: float = 1.0, fused: bool = True):
    """q [X, m, D] (float32, or bfloat16 for the native kernel) against k, v [X, n, D] (the pool's
    dtype; scores scaled by ``scale``);
    bias [X or 1, m, n] additive (``_bias``) or None. ``fused``: a fused CPU kernel where there is
    one (the native kernel without a bias, reading a float32 or bfloat16 pool as it is, else
    torch's on float32), else matrix products. Returns (out [X, m, D], lse [X, m]), float32."""
    native = cpu_attention.kernel_for(q, k) if fused and bias is None else None
    if native is not None:
        return native(q, k, v, scale, 0)
    q, k, v = q.float(), k.float(), v.float()
    if fused and q.device.type == "cpu" and _CPU_FLASH is not None:
        out, lse = _CPU_FLASH(q[:, None], k[:, None], v[:, None], 0.0, False,
                              attn_mask=None if bias is None else bias[:, None], scale=scale)[:2]
        return out[:, 0], lse[:, 0]
    if bias is None:
        s = q @ k.transpose(-1, -2)  # [X, m, n]
        if scale != 1.0:
            s = s * scale
    else:
        s = torch.baddbmm(bias, q, k.transpose(-1, -2), alpha=scale)
    top = s.amax(dim=-1, keepdim=True)
    p = torch.exp(s - top)
    total = p.sum(dim=-1, keepdim=True)
    return (p @ v) / total, (top + total.log()).squeeze(-1)


def _attend_causal(q, k, v, scale: float = 1.0):
    """q [Hk, G, t, D] causally against the same t tokens' k, v [Hk, t, D] (query i sees keys
    0..i; scores scaled by ``scale``). Returns (out [Hk, G, t, D], lse [Hk, G, t])."""
    hk, g, t, d = q.shape
    native = cpu_attention.kernel_for(q, k)
    if native is not None:  # query j of each group sees keys 0..j
        o, l = native(q.reshape(hk, g * t, d), k, v, scale, t)
        return o.view(hk, g, t, d), l.view(hk, g, t)
    q, k, v = q.float(), k.float(), v.float()
    if q.device.type == "cpu" and _CPU_FLASH is not None:
        kx, vx = k[:, None].expand(hk, g, t, d), v[:, None].expand(hk, g, t, d)  # views: no copy
        return _CPU_FLASH(q, kx, vx, 0.0, True, scale=scale)[:2]
    causal = torch.ones((t, t), dtype=torch.bool, device=q.device).tril()
    o, l = _attend(q.reshape(hk, g * t, d), k, v, _bias(causal.repeat(g, 1)[None]), scale)
    return o.view(hk, g, t, d), l.view(hk, g, t)


# torch's fused CPU attention returns the log-sum-exp the merge needs (faster than the same in
# separate ops) and takes a mask; the native kernel (cpu_attention) is faster still where it
# applies (eval/results/attention.md). Without either (another torch build): the ops above
_CPU_FLASH = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def paged_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, pc_plan=None, **kwargs):
    """The registered attention: query [1, Hq, N, D] (new keys/values are already in the pool).
    Returns ([1, N, Hq, D], None) as transformers' attention functions do."""
    if pc_plan is None:
        raise RuntimeError("promptcache_paged attention called without a step plan (a model that does not pass "
                           "its keyword arguments to attention)")
    check_window(pc_plan, module.layer_idx, kwargs)
    return attend(pc_plan, module.layer_idx, query, scaling), None


def check_window(plan: StepPlan, layer: int, kwargs: dict) -> None:
    """The sliding window the model asks this layer's attention for (transformers passes
    ``sliding_window``) must be the one the plan applies: a config the adapter read wrong fails
    loudly, not with a quietly different mask."""
    asked = kwargs.get("sliding_window")
    if asked is not None and plan.keys is not None and asked != plan.keys.window(layer):
        raise RuntimeError(f"layer {layer} asks for a sliding window of {asked}, the step plan applies "
                           f"{plan.keys.window(layer)}")


def attend(plan: StepPlan, layer: int, query: torch.Tensor, scaling: float | None = None) -> torch.Tensor:
    """Attention of one layer's queries [1, Hq, N, D] over the pool as ``plan`` says; [1, N, Hq, D]."""
    _, hq, n, d = query.shape
    scale = plan.scale if plan.scale is not None else (scaling if scaling is not None else 1 / math.sqrt(d))
    if plan.keys is not None:
        return _attend_keyed(plan, layer, query, scale)
    if plan.dense is not None or plan.dense_parts:
        return _attend_pooled(plan, layer, query, scale)
    if plan.decodes_only:
        return _attend_decodes(plan, layer, query, scale)
    kbuf, vbuf = plan.pool.buf[layer, 0], plan.pool.buf[layer, 1]  # [Hk, S, D]
    hk = kbuf.shape[0]
    g = hq // hk
    q, qs = _queries(query, kbuf, scale)  # q head h reads kv head h // g; qs: the scale still to apply
    q = q.view(hk, g, n, d)
    # every query belongs to one row and sees that row's own tokens: their partial results are
    # assigned first, then the shared segments' are merged in
    out = torch.empty((hk, g, n, d), dtype=torch.float32, device=query.device)
    lse = torch.empty((hk, g, n), dtype=torch.float32, device=query.device)
    if plan.decode_q is not None:  # decode rows: their own keys (float32 queries: the gather op's)
        qd = q[:, :, plan.decode_q].transpose(1, 2).contiguous()  # as _queries gives them
        o, l = _attend_own(plan, layer, qd, kbuf, vbuf, qs)
        out[:, :, plan.decode_q] = o.transpose(1, 2)
        lse[:, :, plan.decode_q] = l.transpose(1, 2)
    if plan.prefill_runs is not None:  # prefill rows over runs: every one in one native call
        o, l = _attend_prefill_runs(plan, layer, q, kbuf, vbuf, qs)
        rows = plan.prefill_runs.queries
        out[:, :, rows], lse[:, :, rows] = o, l
    for q0, q1, new, earlier in plan.prefills:  # prefill chunks: own keys, causal among the new ones
        t, rows = q1 - q0, slice(q0, q1)
        # the chunk among itself (causal, no mask tensor), then its earlier own tokens (no mask):
        # a long prefill in chunks spent about half its time in one masked call per chunk
        out[:, :, rows], lse[:, :, rows] = _attend_causal(q[:, :, rows], *_read(kbuf, vbuf, new), qs)
        for part in earlier:
            o, l = _attend(q[:, :, rows].reshape(hk, g * t, d), *_read(kbuf, vbuf, part), None, qs)
            _merge(out, lse, rows, o.view(hk, g, t, d), l.view(hk, g, t))
    _merge_segments(plan, layer, q, qs, out, lse)
    return out.view(hq, n, d).transpose(0, 1)[None].to(query.dtype)


def _merge_segments(plan: StepPlan, layer: int, q: torch.Tensor, qs: float, out: torch.Tensor, lse: torch.Tensor
                    ) -> None:
    """Merge the plan's shared segments (cascade: each read once for every query that needs it)
    and key-limited segments into the running (out [Hk, G, N, D], lse [Hk, G, N]) of queries
    q [Hk, G, N, D] (scores still to scale by ``qs``)."""
    hk, g, n, d = q.shape
    for i, (views, idx) in enumerate(plan.segments):  # shared segments: read once for every query that needs them
        ks, vs = _layer_kv(views, layer)
        shift = plan.segment_shift[i] if plan.segment_shift else None
        if idx.numel() == n:  # every query of the step reads it (one request, or one shared prompt)
            o, l = _attend(_rotated(plan, ("segment", i), q, shift, layer).reshape(hk, g * n, d), ks, vs, None, qs)
            _merge_all(out, lse, o.view(hk, g, n, d), l.view(hk, g, n))
        else:
            rows = _query_rows(plan, i, idx)
            qr = _rotated(plan, ("segment", i), q[:, :, rows], shift, layer)
            o, l = _attend(qr.reshape(hk, -1, d), ks, vs, None, qs)
            _merge(out, lse, rows, o.view(hk, g, -1, d), l.view(hk, g, -1))
    for j, (view, idx, limits) in enumerate(plan.limited):  # prefixes of segments, per query
        rows = _query_rows(plan, ("limited", j), idx)
        m = len(limits)
        qr = _rotated(plan, ("limited", j), q[:, :, rows], plan.limited_shift[j], layer)
        o, l = _attend_limited(plan, j, qr.reshape(hk, g * m, d), view[layer, 0], view[layer, 1], limits, qs)
        _merge(out, lse, rows, o.view(hk, g, m, d), l.view(hk, g, m))


def _attend_pooled(plan: StepPlan, layer: int, query: torch.Tensor, scale: float) -> torch.Tensor:
    """``attend`` without the native kernel: every row's keys held in the pool in one call
    (``attend_dense``), then segments outside the pool merged in (``_merge_segments``)."""
    _, hq, n, d = query.shape
    kv = plan.pool.layers[layer]  # [2, Hk, S, D]
    hk = kv.shape[1]
    q = query.view(hk, hq // hk, n, d)  # splitting the heads: a view whatever the strides
    if q.dtype != torch.float32:
        q = q.float()
    rest = bool(plan.segments or plan.limited)
    if plan.dense is not None:
        out, lse = attend_dense(plan.dense, q, kv, scale, lse=rest)
    else:  # a call a group, each written at its queries
        out = torch.empty((hk, hq // hk, n, d), dtype=torch.float32, device=q.device)
        lse = torch.empty((hk, hq // hk, n), dtype=torch.float32, device=q.device) if rest else None
        for step, idx in plan.dense_parts:
            o, l = attend_dense(step, q.index_select(2, idx), kv, scale, lse=rest)
            if o.dim() == 3:  # decode rows' [n_g, Hq, D]
                o = o.view(-1, hk, hq // hk, d).permute(1, 2, 0, 3)
            out.index_copy_(2, idx, o)
            if rest:
                lse.index_copy_(2, idx, l)
    if rest:
        _merge_segments(plan, layer, q * scale, 1.0, out, lse)
    out = out.unsqueeze(0) if out.dim() == 3 else out.reshape(hq, n, d).transpose(0, 1).unsqueeze(0)
    return out if out.dtype == query.dtype else out.to(query.dtype)


def _rotated(plan: StepPlan, memo_key, q: torch.Tensor, shift: torch.Tensor | None, layer: int) -> torch.Tensor:
    """Queries q [Hk, G, m, D] (rotated at their positions p) as rotated at p - shift for a
    segment whose stored keys lie ``shift`` [m] positions behind where it is read: rotary scores
    depend on q and k's positions only through their difference, so this reads the stored keys
    as if moved (``models.relocate`` moves them instead). Rotations over the first
    ``2 * rope.shape[-1]`` channels with ``layer``'s frequencies (``_layer_rope``), angles in float64
    (built once a step per distinct frequencies). No rope (ALiBi): as they are, the bias reads the
    positions."""
    if shift is None or plan.rope is None:
        return q
    row, rope = _layer_rope(plan, layer)
    memo_key = ("rotation", memo_key, row)
    if memo_key not in plan.memo:  # rotating back by shift: forward by -shift
        cos, sin = rotation(-shift.to(torch.float64), rope)
        plan.memo[memo_key] = (cos.to(q.device), sin.to(q.device))
    cos, sin = plan.memo[memo_key]
    return rotate(q.float(), cos, sin, swap=False).to(q.dtype)


def _layer_rope(plan: StepPlan, layer: int) -> tuple[int, torch.Tensor]:
    """(which distinct frequencies, the frequencies [r / 2]) ``layer`` rotates by: ``plan.rope`` is
    one row for every layer, or a row a layer where layer types have their own base (Gemma 3:
    ``RopeSpec.inv_freq`` [layers, r / 2]; rotations are then built once a distinct row)."""
    if plan.rope.dim() == 1:
        return 0, plan.rope
    if ("rope rows",) not in plan.memo:
        distinct: dict[tuple, int] = {}
        plan.memo[("rope rows",)] = [distinct.setdefault(tuple(r.tolist()), i) for i, r in enumerate(plan.rope)]
    row = plan.memo[("rope rows",)][layer]
    return row, plan.rope[row]


def _attend_limited(plan: StepPlan, j: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, limits: torch.Tensor,
                    scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """q [Hk, G * m, D] (G query heads a KV head, m queries each) over k, v [Hk, n, D], query i
    seeing keys 0 .. limits[i] - 1 (``limits`` [m], 1 .. n): the native kernel's ``attend_limits``
    where it covers them, else a mask (built once a step). Returns (out, lse) float32."""
    g = q.shape[1] // len(limits)
    op = cpu_attention.limits_kernel_for(q, k)
    if op is not None and v.dtype == k.dtype:
        memo_key = ("limits", j)
        if memo_key not in plan.memo:
            plan.memo[memo_key] = limits.repeat(g).to(q.device)
        return op(q, k, v, scale, plan.memo[memo_key])
    memo_key = ("limits-bias", j)
    if memo_key not in plan.memo:
        seen = torch.arange(k.shape[1])[None, :] < limits[:, None]  # [m, n]
        plan.memo[memo_key] = _bias(seen.repeat(g, 1).to(q.device))[None]  # [1, G * m, n]
    return _attend(q, k, v, plan.memo[memo_key], scale)


def _query_rows(plan: StepPlan, i: int, idx: torch.Tensor):
    """Segment ``i``'s queries ``idx`` as a slice where they are consecutive (one request's rows,
    the usual case: read and merged through views, no gathers), else ``idx``; worked out once a
    step (``plan.memo``), not once a layer."""
    key = ("rows", i)
    if key not in plan.memo:
        q = idx.tolist()
        plan.memo[key] = slice(q[0], q[-1] + 1) if q == list(range(q[0], q[-1] + 1)) else idx
    return plan.memo[key]


def _decode_queries(query: torch.Tensor, buf: torch.Tensor) -> torch.Tensor:
    """Decode rows' queries [Hq, B, D] as the gather op reads them: a bfloat16 model's over a
    bfloat16 pool as they are (bfloat16 products for the keys rows share), else float32."""
    if query.dtype == torch.bfloat16 and buf.dtype == torch.bfloat16 and cpu_attention.gathers(buf):
        return query
    return query.float()


def _queries(query: torch.Tensor, buf: torch.Tensor, scale: float) -> tuple[torch.Tensor, float]:
    """One layer's queries [1, Hq, N, D] as the kernels read them, [Hq, N, D], and the scale still
    to apply to their scores: a bfloat16 model's over a bfloat16 pool as they are, for the native
    kernel's bfloat16 products (it scales the float32 scores); else float32, scaled here."""
    if query.dtype == torch.bfloat16 and buf.dtype == torch.bfloat16 \
            and cpu_attention.kernel_for(query[0], buf) is not None:
        return query[0], scale
    return query[0].float() * scale, 1.0


def _attend_keyed(plan: StepPlan, layer: int, query: torch.Tensor, scale: float) -> torch.Tensor:
    """``attend`` for a model whose attention reads key positions (``plan.keys``): decode rows'
    own tokens (gathered, one call), each other row's own tokens and each shared segment are
    partial results, as in ``attend``, computed with the ALiBi bias of their key positions and
    the layer's sliding window (``_key_bias``, ``_decode_bias``); a partial the window hides from
    every query is skipped. The bias depends only on the key's position and head, so the
    log-sum-exp merge stays exact."""
    _, hq, n, d = query.shape
    kbuf, vbuf = plan.pool.buf[layer, 0], plan.pool.buf[layer, 1]
    hk = kbuf.shape[0]
    g = hq // hk
    window = plan.keys.window(layer)
    q = (query[0].float() * scale).view(hk, g, n, d)
    out = torch.zeros((hk, g, n, d), dtype=torch.float32, device=query.device)
    # "nothing yet" as a finite log-sum-exp: a query a partial's window hides merges as weight 0, never NaN
    lse = torch.full((hk, g, n), _EMPTY, dtype=torch.float32, device=query.device)
    if plan.decode_q is not None:  # decode rows: their own keys, gathered (a query always sees itself)
        memo_key = ("decodes", window)
        if memo_key not in plan.memo:
            plan.memo[memo_key] = _decode_bias(plan, hk, g, window, query.device)
        o, l = _attend_own(plan, layer, q[:, :, plan.decode_q].transpose(1, 2).contiguous(), kbuf, vbuf, 1.0,
                           plan.memo[memo_key])
        out[:, :, plan.decode_q] = o.transpose(1, 2)
        lse[:, :, plan.decode_q] = l.transpose(1, 2)
    for i, ((q0, q1, new, earlier), (new_pos, earlier_pos)) in enumerate(zip(plan.prefills, plan.prefill_pos)):
        rows, qpos = slice(q0, q1), plan.qpos[q0:q1]
        qr = q[:, :, rows].reshape(hk, g * (q1 - q0), d)
        _merge_keyed(plan, (i, -1, window), out, lse, rows, qr, _read(kbuf, vbuf, new), qpos, new_pos, window, True)
        for j, (part, pos) in enumerate(zip(earlier, earlier_pos)):
            _merge_keyed(plan, (i, j, window), out, lse, rows, qr, _read(kbuf, vbuf, part), qpos, pos, window)
    for i, ((views, idx), pos) in enumerate(zip(plan.segments, plan.segment_pos)):
        qpos = plan.qpos[idx.cpu()]
        qr = _rotated(plan, ("segment", i), q[:, :, idx], plan.segment_shift[i], layer)
        _merge_keyed(plan, (-1, i, window), out, lse, idx, qr.reshape(hk, g * len(qpos), d),
                     _layer_kv(views, layer), qpos, pos, window)
    for j, ((view, idx, limits), pos) in enumerate(zip(plan.limited, plan.limited_pos)):
        qpos = plan.qpos[idx.cpu()]
        qr = _rotated(plan, ("limited", j), q[:, :, idx], plan.limited_shift[j], layer)
        _merge_keyed(plan, (-2, j, window), out, lse, idx, qr.reshape(hk, g * len(qpos), d),
                     (view[layer, 0], view[layer, 1]), qpos, pos, window, limits=limits)
    return out.view(hq, n, d).transpose(0, 1)[None].to(query.dtype)


_EMPTY = -1e30  # the log-sum-exp of no key yet (finite: exp(_EMPTY - _EMPTY) is 1, not NaN)


def _merge_keyed(plan: StepPlan, memo_key, out, lse, rows, q, kv, qpos, kpos, window, causal: bool = False,
                 limits: torch.Tensor | None = None) -> None:
    """One partial result of ``_attend_keyed``: queries q [Hk, G * m, D] (positions qpos [m],
    host) over keys/values [Hk, n, D] (positions kpos [n], host), merged into (out, lse) at
    ``rows``; ``causal``: the keys are the queries' own new tokens (query i sees keys 0..i);
    ``limits`` [m]: query i sees keys 0 .. limits[i] - 1 only."""
    hk, gm, d = q.shape
    m = len(qpos)
    g = gm // m
    if memo_key not in plan.memo:
        plan.memo[memo_key] = _key_bias(plan.keys, hk, g, qpos, kpos, window, causal, q.device, limits)
    bias, dead = plan.memo[memo_key]
    if bias is False:  # the window hides every key from every query
        return
    o, l = _attend(q, *kv, bias, 1.0)
    if dead is not None:  # queries that see none of these keys: weight 0
        o = o.masked_fill(dead[None, :, None], 0.0)
        l = l.masked_fill(dead[None, :], float("-inf"))
    _merge(out, lse, rows, o.view(hk, g, m, d), l.view(hk, g, m))


def _key_bias(keys: KeyRule, hk: int, g: int, qpos, kpos, window, causal: bool, dev, limits=None):
    """(additive float32 bias [Hk, G * m or 1, n] or None, dead queries [G * m] bool or None) of
    a partial, or (False, None) where no query sees any key. The bias: the ALiBi term of each
    key (per query head) plus -inf where the window, causality or a key limit hides a key."""
    m, n = len(qpos), len(kpos)
    visible = torch.ones((m, n), dtype=torch.bool).tril() if causal else None
    if limits is not None:
        visible = torch.arange(n)[None, :] < limits.cpu()[:, None]
    if window is not None and int(qpos.max()) - int(kpos.min()) >= window:
        inside = kpos[None, :] > qpos[:, None] - window
        visible = inside if visible is None else visible & inside
    if visible is not None and not bool(visible.any()):
        return False, None
    bias = None
    if keys.bias is not None:
        bias = keys.bias(kpos.to(dev)).float().view(hk, g, 1, n)
    if visible is not None:
        mask = _bias(visible.to(dev))[None, None]  # [1, 1, m, n]
        bias = mask if bias is None else bias + mask
    if bias is None:
        return None, None
    if bias.shape[1] == 1 and bias.shape[2] == 1:  # one row per kv head, broadcast over its queries
        bias = bias.view(bias.shape[0], 1, n)
    else:
        bias = bias.expand(hk, g, m, n).reshape(hk, g * m, n)
    dead = None
    if visible is not None and not bool(visible.any(dim=1).all()):
        dead = (~visible.any(dim=1)).repeat(g).to(dev)
    return bias, dead


def _attend_decodes(plan: StepPlan, layer: int, query: torch.Tensor, scale: float) -> torch.Tensor:
    """``attend`` for a step of decode rows only (row i's query is query i), every segment read by
    all of them: no scatter of partial results into a step-wide buffer, the scale passed to the
    fused kernel, and two partial results merged as one interpolation,
    out = o2 + sigmoid(l1 - l2) (o1 - o2): the log-sum-exp merge rewritten (weights
    e^l1 / (e^l1 + e^l2) and its complement). ~20 ops a layer instead of ~50."""
    _, hq, b, d = query.shape
    kbuf, vbuf = plan.pool.buf[layer]  # [Hk, S, D] each
    hk = kbuf.shape[0]
    g = hq // hk
    q = _decode_queries(query[0], kbuf).view(hk, g, b, d).transpose(1, 2).contiguous()  # [Hk, B, G, D]
    out, lse = _attend_own(plan, layer, q, kbuf, vbuf, scale)
    out, lse = out.view(hk, b * g, d), lse.view(hk, b * g)  # the same memory as [Hk, B * G, ...]
    for i, (views, _) in enumerate(plan.segments):
        sk, sv = _layer_kv(views, layer)
        o, l = _attend(q.view(hk, b * g, d), sk, sv, None, scale)
        w = torch.sigmoid(lse - l)
        if i + 1 < len(plan.segments):  # a later merge needs the running log-sum-exp
            lse = torch.logaddexp(lse, l)
        out = torch.lerp(o, out, w[..., None])
    # [Hk, B, G, D] -> [1, B, Hq, D]
    return out.view(hk, b, g, d).transpose(0, 1).reshape(1, b, hq, d).to(query.dtype)


def _attend_own(plan: StepPlan, layer: int, q: torch.Tensor, kbuf: torch.Tensor, vbuf: torch.Tensor, scale: float,
                bias: torch.Tensor | None = None):
    """Decode rows' queries q [Hk, B, G, D] (contiguous) over their own keys (``plan.decode_slots``
    of a layer's pool buffers [Hk, S, D]). ``bias`` [Hk * B, G or 1, K]: in place of
    ``plan.decode_bias`` (``_decode_bias``). Returns (out [Hk, B, G, D], lse [Hk, B, G])."""
    hk, b, g, d = q.shape
    if plan.decode_runs is not None:  # runs of store tensors' keys or keys read shifted: the query rotated per run
        gather = cpu_attention.gather_runs_kernel_for(q, kbuf) if bias is None else None
        if gather is None:  # build_plan folds runs only where the gather op reads them
            raise RuntimeError("decode rows fold segments as runs but the native gather op does not cover "
                               f"queries {tuple(q.shape)} {q.dtype} over a {kbuf.dtype} pool")
        runs = plan.decode_runs
        cos, sin = _run_rotation(plan, runs, layer)
        return gather(q, kbuf, vbuf, plan.decode_slots, plan.decode_lengths, scale, runs.starts, runs.src, runs.rot,
                      cos, sin, runs.sources, layer)
    gather = cpu_attention.gather_kernel_for(q, kbuf) if bias is None else None
    if gather is not None:  # read from their slots in place
        return gather(q, kbuf, vbuf, plan.decode_slots, plan.decode_lengths, scale)
    width = plan.decode_slots.shape[1]
    flat = plan.decode_slots.view(-1)  # index_select: much faster than advanced indexing here
    ks = kbuf.index_select(1, flat).float().view(hk * b, width, d)
    vs = vbuf.index_select(1, flat).float().view(hk * b, width, d)
    o, l = _attend(q.view(hk * b, g, d), ks, vs, plan.decode_bias if bias is None else bias, scale,
                   fused=b < DECODE_MATMUL_ROWS)
    return o.view(hk, b, g, d), l.view(hk, b, g)


def _attend_prefill_runs(plan: StepPlan, layer: int, q: torch.Tensor, kbuf: torch.Tensor, vbuf: torch.Tensor,
                         scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The prefill rows' queries (of q [Hk, G, N, D]) over their runs (``plan.prefill_runs``): their
    folded segments, each query seeing its prefix of each, and their own tokens, causal. Returns
    (out [Hk, G, M, D], lse [Hk, G, M]) of the rows' M queries."""
    pr = plan.prefill_runs
    qp = q[:, :, pr.queries]
    op = cpu_attention.prefill_runs_kernel_for(qp, kbuf)
    if op is None:  # build_plan folds prefill rows only where the native op reads them
        raise RuntimeError("prefill rows fold segments as runs but the native prefill op does not cover "
                           f"queries {tuple(qp.shape)} {qp.dtype} over a {kbuf.dtype} pool")
    runs = pr.runs
    cos, sin = _run_rotation(plan, runs, layer)
    return op(qp, kbuf, vbuf, pr.slots, pr.lengths, scale, runs.starts, runs.src, runs.rot, cos, sin, runs.sources,
              layer, pr.query_row, pr.limits)


def _run_rotation(plan: StepPlan, runs: DecodeRuns, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [S, r] rotating queries back by each of ``runs``' shifts at ``layer``'s frequencies."""
    return runs.rotation(*_layer_rope(plan, layer)) if plan.rope is not None else runs.rotation(0, None)


def _layer_kv(views: list[torch.Tensor], layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values [Hk, n, D] (the pool's dtype: ``_attend`` widens them where its kernel does
    not read them as they are) of one layer of segments read together."""
    if len(views) == 1:
        return views[0][layer, 0], views[0][layer, 1]
    kv = torch.cat([v[layer] for v in views], dim=2)  # [2, Hk, n, D]
    return kv[0], kv[1]


def _parts(slots: torch.Tensor, most: int) -> list[slice | torch.Tensor]:
    """Pool slots as parts to read: their ascending runs (slices: read in place), or all of them
    gathered (one LongTensor) when there are more than ``most`` runs. A request reusing a cached
    prefix owns that prefix's blocks and then blocks of its own elsewhere in the pool: gathering
    its earlier tokens every layer cost a few percent of a short step (eval/results/design_figures.md)."""
    return [p for p, _, _ in _parts_at(slots, most)]


def _parts_at(slots: torch.Tensor, most: int) -> list[tuple[slice | torch.Tensor, int, int]]:
    """``_parts``, each with the range [a, b) of ``slots`` it holds."""
    if slots.numel() == 0:
        return []
    host = slots.cpu()
    cuts = [0] + (torch.nonzero(host[1:] - host[:-1] != 1).flatten() + 1).tolist() + [host.numel()]
    if len(cuts) - 1 > most:
        return [(slots, 0, host.numel())]
    return [(slice(int(host[a]), int(host[a]) + b - a), a, b) for a, b in zip(cuts, cuts[1:])]


def _read(kbuf: torch.Tensor, vbuf: torch.Tensor, part: slice | torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values [Hk, n, D] (the pool's dtype, as ``_layer_kv``) of a part (``_parts``) of a
    layer's pool buffers."""
    if isinstance(part, slice):
        return kbuf[:, part], vbuf[:, part]
    return kbuf.index_select(1, part), vbuf.index_select(1, part)


AttentionInterface.register(ATTENTION_NAME, paged_attention)


def write_kv(pool: KVPool, layer: int, slots: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> None:
    """A step's new keys/values [1, H, N, D] of one layer into pool slots [N]."""
    kbuf, vbuf = pool.layer_kv[layer]
    kbuf.index_copy_(1, slots, key[0] if key.dtype == kbuf.dtype else key[0].to(kbuf.dtype))
    vbuf.index_copy_(1, slots, value[0] if value.dtype == vbuf.dtype else value[0].to(vbuf.dtype))


class _PagedLayer(CacheLayerMixin):
    """Writes a step's new keys/values [1, H, N, D] into their pool slots; attention reads the pool."""

    is_sliding = False
    is_compileable = False

    def __init__(self, pool: KVPool, index: int, slots: torch.Tensor):  # no super().__init__: nothing to hold
        self.pool, self.index, self.slots = pool, index, slots
        self.is_initialized = True

    def lazy_initialization(self, key_states, value_states) -> None:
        pass

    def update(self, key_states, value_states, *args, **kwargs):
        write_kv(self.pool, self.index, self.slots, key_states, value_states)
        return key_states, value_states

    def get_seq_length(self) -> int:
        return 0

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return query_length, 0

    def get_max_length(self) -> int:
        return -1

    get_max_cache_shape = get_max_length


class PagedCache(Cache):
    """The ``past_key_values`` of a paged step: only the slots its new tokens go to."""

    def __init__(self, pool: KVPool, slots: torch.Tensor):
        super().__init__(layers=[_PagedLayer(pool, i, slots) for i in range(pool.spec.layers)])


@contextmanager
def attention_swapped(runner, name: str = ATTENTION_NAME, **extra):
    """The model's attention is ``name`` for one forward (``Adapter.attention_as``), then what it
    was: nothing changes for any other forward. A family that computes attention inline (ALiBi:
    no attention interface) has its attention modules run ``name`` instead for that forward
    (``Adapter.paged_attention``), with ``extra`` keyword arguments."""
    adapter = runner.adapter
    if adapter.inline_attention:
        function = ALL_ATTENTION_FUNCTIONS[name]

        def attend(module, query, key, value, cache, scaling):  # [1, H, t, D] each -> [1, t, Hq, D]
            if cache is not None:  # a paged forward's PagedCache writes them into the pool
                key, value = cache.update(key, value, module.layer_idx)
            return function(module, query, key, value, None, scaling=scaling, **extra)[0]

        with adapter.paged_attention(attend):
            yield
        return
    with adapter.attention_as(name):
        yield


@torch.inference_mode()
def paged_forward(runner, pool: KVPool, rows: list[PagedRow]) -> torch.Tensor:
    """One forward of every row's new tokens; logits [k, V] of the rows with ``logits`` set, in order."""
    ids, pos, write, ends = step_inputs(pool, rows)
    keep = on_device(ends, pool.buf.device)
    plan = build_plan(pool, rows, keys=key_rule(runner.adapter), rope=query_rope(runner.adapter, rows))
    kwargs = {"position_ids": pos} if runner.adapter.passes_position_ids else {}
    with runner.lock, attention_swapped(runner, pc_plan=plan):
        out = runner.model(input_ids=ids, past_key_values=PagedCache(pool, write), use_cache=True,
                           logits_to_keep=keep, pc_plan=plan, **kwargs)
    return out.logits[0]


def query_rope(adapter, rows: list[PagedRow]) -> torch.Tensor | None:
    """The rotary frequencies queries are rotated by where some row reads a segment shifted
    (None: no row does, or the model's keys carry no position: ALiBi). A model whose stored states
    cannot be read at another position is refused (``Adapter.relocation``)."""
    if not any(any(r.shifts()) for r in rows):
        return None
    if adapter.relocation == "positions_only":
        return None
    if adapter.relocation != "rotate_keys":
        raise ValueError(f"{adapter.config.model_type}: stored states cannot be read at another position "
                         f"({adapter.relocation_refusal or 'not relocatable'})")
    return rope_spec(adapter).inv_freq


def step_inputs(pool: KVPool, rows: list[PagedRow]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[int]]:
    """The packed step's ids [1, N], position IDs [1, N], pool slots its tokens go to [N], and
    the packed index of each row's last token where the row wants logits (``step_ids``,
    ``step_places``)."""
    places = step_places(pool, rows)
    ends, off = [], 0
    for r in rows:
        off += len(r.ids)
        if r.logits:
            ends.append(off - 1)
    return step_ids(pool, rows), places[:1], places[1], ends


def step_ids(pool: KVPool, rows: list[PagedRow]) -> torch.Tensor:
    """The packed step's ids [1, N]. Ids kept on the device (``PagedRow.sampled``: every row's, in
    order) are used as they are."""
    sampled = rows[0].sampled if rows else None
    if sampled is not None and sampled.shape[0] == len(rows) and all(r.sampled is sampled for r in rows):
        return sampled.view(1, -1)
    return on_device([[t for r in rows for t in r.ids]], pool.buf.device)


def step_places(pool: KVPool, rows: list[PagedRow]) -> torch.Tensor:
    """The packed step's position IDs and the pool slots its tokens go to, as one tensor [2, N]:
    from the rows' block tables one host-to-device copy whatever the rows (else a slice a row)."""
    dev = pool.buf.device
    pos = [p for r in rows for p in r.pos]
    if all(r.own_blocks is not None for r in rows):
        bs = pool.block_size
        write = [r.own_blocks[i // bs] * bs + i % bs for r in rows
                 for i in range(r.own_count - len(r.ids), r.own_count)]
        return on_device([pos, write], dev)
    write = torch.cat([r.own_slots[r.own_count - len(r.ids) : r.own_count] for r in rows]).to(dev)
    return torch.stack((on_device(pos, dev), write))


def paged_refusal(runner) -> str | None:
    """Why this runner's model cannot serve from the paged pool (None: it can): a paged forward
    that fails its self-check. The check runs a prompt split into a shared segment, an earlier
    chunk and a last chunk, with a decode row beside it, twice: at contiguous positions against
    the stock forward, and with a gap after the shared segment against the adapter's forward at
    those positions (ALiBi: its bias from our positions). A model with a sliding window of at
    most ``_CHECKED_WINDOW`` positions (the same in every layer) gets a prompt longer than the
    window, so the window is checked too (the gapped reference then applies it by position ID)."""
    try:
        diff, tol = max(_self_check(runner, gap=0), _self_check(runner, gap=3))
    except Exception as e:  # noqa: BLE001 - any failure means: not this way
        return f"the paged forward failed its self-check ({type(e).__name__}: {e})"
    if not diff <= tol:
        return f"the paged forward failed its self-check: it differs from the stock forward by {diff:.3g} " \
               f"(tolerance {tol:.3g})"
    return None


_CHECKED_WINDOW = 64  # longest sliding window the self-check's prompt reaches past


def _self_check(runner, gap: int) -> tuple[float, float]:
    model, spec, dev, adapter = runner.model, runner.spec, runner.device, runner.adapter
    keys = key_rule(adapter)
    window = min((w for w in keys.windows if w), default=None) if keys is not None and keys.windows else None
    n = 11 if window is None or window > _CHECKED_WINDOW else max(11, window + 6)
    vocab = model.get_input_embeddings().num_embeddings
    ids = ((torch.arange(n) * 7 + 5) % vocab).tolist()
    pos = list(range(4)) + list(range(4 + gap, n + gap))  # a gap after the shared segment
    if gap == 0:
        with torch.inference_mode():
            stock = model(input_ids=torch.tensor([ids], device=dev), use_cache=False).logits[0].float()  # [n, V]
        want = torch.stack([stock[6], stock[4], stock[n - 1], stock[5]])
    else:
        want = torch.stack([_reference(runner, keys, ids[: k + 1], pos[: k + 1]) for k in (6, 4, n - 1, 5)])
    pool = KVPool(spec, dev, tokens=4 * (n + 8), block_size=4)
    shared = pool.allocate(1)  # tokens 0..3 as a shared segment
    own_a, own_b = pool.allocate(pool.blocks_for(n - 4)), pool.allocate(2)
    paged_forward(runner, pool, [PagedRow(ids[:4], pos[:4], [], pool.slots(shared, 0, 4), logits=False)])
    seg, seg_pos = [("s", pool.views(shared, 4)[0])], [torch.tensor(pos[:4])]
    first = [PagedRow(ids[4:7], pos[4:7], seg, pool.slots(own_a, 0, 3), shared_pos=seg_pos, own_pos=pos[4:7]),
             PagedRow(ids[4:5], pos[4:5], seg, pool.slots(own_b, 0, 1), shared_pos=seg_pos, own_pos=pos[4:5])]
    got1 = paged_forward(runner, pool, first).float()
    second = [PagedRow(ids[7:], pos[7:], seg, pool.slots(own_a, 0, n - 4), shared_pos=seg_pos, own_pos=pos[4:]),
              PagedRow(ids[5:6], pos[5:6], seg, pool.slots(own_b, 0, 2), shared_pos=seg_pos, own_pos=pos[4:6])]
    got2 = paged_forward(runner, pool, second).float()
    got = torch.cat([got1, got2])
    tol = max(1e-4, 16 * torch.finfo(spec.dtype).eps) * max(1.0, want.abs().max().item())
    return (got - want).abs().max().item(), tol


def _reference(runner, keys: KeyRule | None, ids: list[int], pos: list[int]) -> torch.Tensor:
    """What the model computes for ``ids`` at ``pos`` from an empty cache: last logits [V]. The
    adapter's forward (ALiBi: its bias from our positions), or, under sliding windows, the stock
    forward with each layer type's mask built from position IDs (a key is seen from positions
    below its own + window)."""
    adapter, dev = runner.adapter, runner.device
    ids_t, pos_t = torch.tensor([ids], device=dev), torch.tensor([pos], device=dev)
    if keys is None or keys.windows is None:
        return adapter.forward(ids_t, pos_t, SpliceCache(runner.spec, len(ids), device=dev))[0].float()
    p = pos_t[0]
    causal = torch.ones((len(ids), len(ids)), dtype=torch.bool, device=dev).tril()

    def mask(window):
        m = causal if window is None else causal & (p[None, :] > p[:, None] - window)
        return adapter.mask_kwargs(m[None, None])["attention_mask"]

    types = getattr(runner.model.config, "layer_types", None)
    masks = {t: mask(w) for t, w in zip(types, keys.windows)} if types else mask(keys.windows[0])
    with torch.inference_mode():
        out = runner.model(input_ids=ids_t, position_ids=pos_t, attention_mask=masks, use_cache=False)
    return out.logits[0, -1].float()
