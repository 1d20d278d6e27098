"""Rows' keys as runs for the native gather ops: every row's documents in one call a layer.

A decode row reads its shared segments (a prompt's prefix held in the pool, documents read in place
from a store's tensors, each at whatever position the row puts it) and its own tokens. The native
gather op (``kernels/attention.cpp``: ``attend_gather_runs``) reads each row's keys by slot, in
runs: a run's keys lie in the pool or in one store tensor (a *source*) and are read with the row's
query rotated back by the run's shift (a document stored ``shift`` positions behind where the row
reads it: rotary scores depend only on the difference of positions). ``RunTable`` collects the
rows' parts once a step (``paged.build_plan``); ``DecodeRuns`` is what every layer hands the op:

  * ``slots`` of each row (pool slots, or token indices inside the run's source);
  * ``starts``, ``src``, ``rot`` [B, R]: where each run begins in the row's slot list, its source
    (-1: the pool; s: ``sources[s]``) and its rotation (an index into ``shifts``; -1: none);
  * ``sources``: one tensor [L, 2, Hk, n, D] per store storage the step reads (the pieces of one
    document a recompute cut apart are tokens of one source), read at the layer's index;
  * ``shifts`` [S]: the step's distinct shifts; ``rotation`` builds cos/sin [S, r] once a step per
    distinct rotary frequencies (Gemma 3: a base per layer type).

Prefill rows (chunks, selective recompute's rows) take the same table (``RunTable(merge=False)``:
one run per segment, as each has its own key limits) and ``PrefillRuns``: their queries, each
query's row and how many keys of each run it sees (a document's prefix in prompt order, causal
over the row's own tokens), for the native ``attend_prefill_runs``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .dense import rotation

__all__ = ["DecodeRuns", "PrefillRuns", "RunTable"]


@dataclass
class DecodeRuns:
    """The run table of a step's decode rows (``RunTable.build``)."""

    starts: torch.Tensor  # [B, R] int64: the first slot of each run (padding runs: empty, at the row's length)
    src: torch.Tensor  # [B, R] int64: -1 the pool, s >= 0 ``sources[s]``
    rot: torch.Tensor  # [B, R] int64: an index into ``shifts``, -1 not rotated
    shifts: torch.Tensor  # [S] float64: the step's distinct shifts
    sources: list[torch.Tensor]  # [L, 2, Hk, n, D] each
    memo: dict = field(default_factory=dict)

    def rotation(self, row: int, rope: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [S, r] (float32, contiguous) rotating a query back by each shift at the rotary
        frequencies ``rope`` [r / 2] (``row``: which distinct frequencies they are; built once a
        step each); [0, 0] where nothing is rotated."""
        if row not in self.memo:
            if self.shifts.numel() == 0 or rope is None:
                empty = torch.zeros((0, 0), dtype=torch.float32)
                self.memo[row] = (empty, empty)
            else:
                cos, sin = rotation(-self.shifts, rope)
                self.memo[row] = (cos.contiguous(), sin.contiguous())
        return self.memo[row]


@dataclass
class PrefillRuns:
    """The run table of a step's prefill rows (``RunTable.prefills``)."""

    runs: DecodeRuns
    slots: torch.Tensor  # [B, W] int64: each row's slot list (padded with 0)
    lengths: torch.Tensor  # [B] int64
    queries: slice | torch.Tensor  # the step's queries (packed index) of these rows, in row order
    query_row: torch.Tensor  # [M] int64: each query's row
    limits: torch.Tensor  # [M, R] int64: keys of each run of its row each query sees


class RunTable:
    """Collects rows' parts (``pool``, ``view``, ``own``) and builds their ``DecodeRuns``.
    ``buf``: the pool's buffer [L, 2, Hk, S, D] (a store tensor is read in place only in its dtype
    and layout). ``merge``: adjacent parts of one source and shift are one run (decode rows; prefill
    rows keep a run a part, each with its own key limits)."""

    def __init__(self, buf: torch.Tensor, merge: bool = True):
        self.buf = buf
        self.merge = merge
        self._limits: list[torch.Tensor] = []  # prefill rows: per query [t, runs] of the rows so far
        self._queries: list[tuple[int, int]] = []  # prefill rows: their queries [q0, q1)
        self._slot_lists: list[torch.Tensor] = []
        self.rows: list[list[tuple[int, int, int]]] = []  # per row: (first slot, source, shift) of each run
        self._row: list[tuple[int, int, int]] = []  # the row being added: its runs, its slots' parts
        self._parts: list[torch.Tensor] = []
        self._at = 0
        self._groups: dict[tuple, int] = {}  # (storage, strides, offset residue) -> source index
        self._reach: list[int] = []  # tokens each source must cover
        self._anchors: list[torch.Tensor] = []  # a view of each source's storage
        self.used = False  # some run is shifted or lies outside the pool

    def pool(self, slots: torch.Tensor, shift: int) -> None:
        """A segment held in the pool, its slots [n]."""
        self._add(slots, -1, shift)

    def view(self, view: torch.Tensor, shift: int) -> bool:
        """A store tensor [L, 2, Hk, n, D] read in place; False where the op cannot read it (another
        dtype, device or layout: the caller keeps it a segment of its own)."""
        buf = self.buf
        if view.dim() != 5 or view.dtype != buf.dtype or view.device != buf.device or view.stride(4) != 1 \
                or view.shape[:3] != buf.shape[:3] or view.shape[4] != buf.shape[4] or view.stride(3) <= 0:
            return False
        step = view.stride(3)
        first, residue = divmod(view.storage_offset(), step)
        key = (view.untyped_storage().data_ptr(), view.stride(), residue)
        s = self._groups.get(key)
        if s is None:
            s = self._groups[key] = len(self._reach)
            self._reach.append(0)
            self._anchors.append(view)
        n = view.shape[3]
        self._reach[s] = max(self._reach[s], first + n)
        self._add(torch.arange(first, first + n, dtype=torch.long), s, shift)
        return True

    def own(self, slots: torch.Tensor) -> torch.Tensor:
        """The row's own tokens (pool slots, not shifted) after its shared parts: its whole slot
        list; the next call starts the next row."""
        self._add(slots, -1, 0)
        parts, self._parts, self._at = self._parts, [], 0
        self.rows.append(self._row)
        self._row = []
        return torch.cat(parts) if len(parts) > 1 else parts[0]

    def _add(self, slots: torch.Tensor, src: int, shift: int) -> None:
        if shift or src >= 0:
            self.used = True
        if not self.merge or not self._row or self._row[-1][1:] != (src, shift):
            self._row.append((self._at, src, shift))
        self._parts.append(slots)
        self._at += slots.shape[0]

    def prefill(self, slots: torch.Tensor, q0: int, t: int, limits: list[torch.Tensor | None]) -> None:
        """A prefill row's own tokens (pool slots ``slots`` [done + t], the last t its queries
        ``q0 .. q0 + t``) after its shared parts (``limits``: per part added, the keys [t] each query
        sees, or None: all of them); ends the row (``merge=False`` tables only)."""
        if len(limits) != len(self._row):
            raise ValueError(f"a prefill row has {len(self._row)} shared parts and {len(limits)} key limits")
        cols = [torch.full((t,), p.shape[0], dtype=torch.long) if lim is None else lim.to("cpu", torch.long)
                for lim, p in zip(limits, self._parts)]
        n = slots.shape[0]
        cols.append(torch.arange(n - t + 1, n + 1, dtype=torch.long))  # causal over its own tokens
        self._limits.append(torch.stack(cols, dim=1))
        self._queries.append((q0, q0 + t))
        self._slot_lists.append(self.own(slots))

    def prefills(self) -> PrefillRuns:
        """The ``PrefillRuns`` of the prefill rows so far (``prefill``)."""
        lengths = [len(s) for s in self._slot_lists]
        runs = self.build(lengths)
        width = runs.starts.shape[1]
        slots = torch.zeros((len(lengths), max(lengths)), dtype=torch.long)
        for i, s in enumerate(self._slot_lists):
            slots[i, : len(s)] = s.cpu()
        limits = torch.cat([torch.nn.functional.pad(lim, (0, width - lim.shape[1])) for lim in self._limits])
        rows = torch.cat([torch.full((q1 - q0,), i, dtype=torch.long) for i, (q0, q1) in enumerate(self._queries)])
        spans = self._queries
        if all(a[1] == b[0] for a, b in zip(spans, spans[1:])):
            queries: slice | torch.Tensor = slice(spans[0][0], spans[-1][1])
        else:
            queries = torch.cat([torch.arange(q0, q1, dtype=torch.long) for q0, q1 in spans])
        return PrefillRuns(runs, slots, torch.tensor(lengths, dtype=torch.long), queries, rows, limits.contiguous())

    def build(self, lengths: list[int]) -> DecodeRuns:
        """The table of the rows so far (``lengths``: each row's slots), padded to the most runs."""
        width = max(len(r) for r in self.rows)
        index: dict[int, int] = {}
        starts, src, rot = [], [], []
        for runs, n in zip(self.rows, lengths):
            pad = width - len(runs)
            starts.append([a for a, _, _ in runs] + [n] * pad)
            src.append([s for _, s, _ in runs] + [-1] * pad)
            rot.append([index.setdefault(sh, len(index)) if sh else -1 for _, _, sh in runs] + [-1] * pad)
        sources = [torch.as_strided(v, (*v.shape[:3], reach, v.shape[4]), v.stride(),
                                    v.storage_offset() % v.stride(3))
                   for v, reach in zip(self._anchors, self._reach)]
        return DecodeRuns(torch.tensor(starts, dtype=torch.long), torch.tensor(src, dtype=torch.long),
                          torch.tensor(rot, dtype=torch.long), torch.tensor(list(index), dtype=torch.float64), sources)
