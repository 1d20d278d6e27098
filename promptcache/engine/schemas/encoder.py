"""Encode a schema's modules: every encoding pass of ``SchemaLayout.passes()``, run on the model.

The default pass (every union represented by its scaffold member) runs once, in chunks. Every
other pass shares a prefix with it (the schema text before the first union it changes); that
prefix's states are reused, exactly (attention is causal), and only the rest is run:
  * alone, in place on the default pass's cache (passes sorted by prefix, longest first, so a
    later pass never reads slots an earlier one overwrote);
  * or batched with passes that share the prefix and start at the same position (members of one
    union), right-padded: padding comes after every real token, so causal attention never sees it.

Memory: states come out in the runner's stored dtype (``stored_spec.dtype``): one copy per span
out of the encoding buffer, converting as it copies. The encoding buffers are dropped before
``encode`` returns and, on glibc, freed pages go back to the OS (``malloc_trim``): a process
that encoded a schema holds its stored states, not the buffers they were computed in.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
from dataclasses import dataclass
from typing import Callable

import torch

from ...models.splice import SpliceCache
from ...layout import EncodePass, SchemaLayout
from ..prefill.runner import ModelRunner

log = logging.getLogger(__name__)

Progress = Callable[[int, int], None]  # (tokens done, tokens total)


@dataclass
class _Job:
    pass_: EncodePass
    prefix: int  # spans shared with the default sequence
    prefix_tokens: int
    ids: list[int]  # the rest of the pass
    pos: list[int]


class SchemaEncoder:
    """Runs encoding passes on a ``ModelRunner`` (its forwards take the runner's lock)."""

    def __init__(self, runner: ModelRunner, chunk: int = 2048, batch_bytes: int = 256 << 20, pad_id: int = 0):
        self.runner, self.adapter, self.spec, self.device = runner, runner.adapter, runner.spec, runner.device
        self.chunk, self.batch_bytes, self.pad_id = chunk, batch_bytes, pad_id
        self.out_dtype = runner.stored_spec.dtype  # states leave the encoder in the stored dtype

    def encode(self, layout: SchemaLayout, progress: Progress | None = None) -> dict[int, torch.Tensor]:
        """Stored span index -> key/value states [L, 2, H, n, D] on the engine's device."""
        spans = layout.spans
        defaults = {u.index: u.scaffold for u in layout.unions.values()}
        default_seq = [s.index for s in spans if all(defaults[u] == m for u, m in s.choices)]
        offsets = _offsets([len(spans[i].token_ids) for i in default_seq])  # token offset per default span
        jobs, default_targets, need = [], [], 0
        for p in layout.passes():
            c = _common_prefix(p.spans, default_seq)
            need = max(need, c)
            if c == len(p.spans):
                default_targets += p.targets
            else:
                rest = p.spans[c:]
                jobs.append(_Job(p, c, offsets[c], _cat(spans, rest, "ids"), _cat(spans, rest, "pos")))
        ids = _cat(spans, default_seq[:need], "ids")
        pos = _cat(spans, default_seq[:need], "pos")
        total = len(ids) + sum(len(j.ids) for j in jobs)  # tokens run (parameter slots, shared prefixes)
        done, stored = 0, layout.stored_tokens

        def tick(n):  # progress counts stored tokens, the count compile and inspect print
            nonlocal done
            done += n
            if progress:
                progress(done * stored // max(total, 1), stored)

        self.adapter.check_limits(max(pos + [q for j in jobs for q in j.pos], default=0), len(ids) + max((len(j.ids) for j in jobs), default=0))
        out: dict[int, torch.Tensor] = {}
        cache = SpliceCache(self.spec, len(ids) + max((len(j.ids) for j in jobs), default=0), device=self.device)
        self._run_chunked(ids, pos, cache, tick)
        where = {i: offsets[k] for k, i in enumerate(default_seq[:need])}
        for t in default_targets:
            out[t] = self._read(cache, where[t], len(spans[t].token_ids))
        batched, single = self._group(jobs)
        for group in batched:
            self._run_batch(group, cache, spans, out)
            tick(sum(len(j.ids) for j in group))
        for job in sorted(single, key=lambda j: -j.prefix):
            cache.set_length(job.prefix_tokens)
            self._forward([job.ids], [job.pos], cache)
            self._collect(job, cache, 0, spans, out)
            tick(len(job.ids))
        cache.free()
        release_free_memory(self.device)
        log.info("encoded schema '%s': %d passes, %d tokens run", layout.name, len(jobs) + 1, total)
        return out

    def encode_alone(self, ids: list[int], start: int = 0) -> torch.Tensor:
        """Tokens with no context at positions start..start+n-1: states [L, 2, H, n, D]."""
        pos = list(range(start, start + len(ids)))
        self.adapter.check_limits(pos[-1] if pos else 0, len(ids))
        cache = SpliceCache(self.spec, len(ids), device=self.device)
        self._run_chunked(ids, pos, cache)
        kv = cache.read(0, len(ids))  # the model's dtype: callers store what they are given
        cache.free()
        return kv

    def _run_chunked(self, ids: list[int], pos: list[int], cache: SpliceCache, tick=None) -> None:
        """One sequence through the model in chunks of ``self.chunk`` tokens (exact: causal)."""
        for a in range(0, len(ids), self.chunk):
            self._forward([ids[a : a + self.chunk]], [pos[a : a + self.chunk]], cache)
            if tick:
                tick(len(ids[a : a + self.chunk]))

    def _group(self, jobs: list[_Job]) -> tuple[list[list[_Job]], list[_Job]]:
        """Batch passes sharing a prefix whose positions run contiguously from one start."""
        keyed: dict[tuple, list[_Job]] = {}
        for j in jobs:
            contiguous = j.pos == list(range(j.pos[0], j.pos[0] + len(j.pos)))
            keyed.setdefault((j.prefix, j.pos[0]) if contiguous else (id(j),), []).append(j)
        batched, single = [], []
        for group in keyed.values():
            width = self.spec.bytes_per_token * (group[0].prefix_tokens + max(len(j.ids) for j in group))
            size = max(1, min(len(group), self.batch_bytes // max(width, 1)))
            for a in range(0, len(group), size):
                part = group[a : a + size]
                (batched.append(part) if len(part) > 1 else single.extend(part))
        return batched, single

    def _run_batch(self, group: list[_Job], base: SpliceCache, spans, out) -> None:
        p, t = group[0].prefix_tokens, max(len(j.ids) for j in group)
        cache = SpliceCache(self.spec, p + t, batch=len(group), device=self.device)
        for row in range(len(group)):
            cache.buf[:, :, row, :, :p] = base.buf[:, :, 0, :, :p]
            cache.positions[row, :p] = base.positions[0, :p]
        cache.set_length(p)
        start = group[0].pos[0]
        ids = [j.ids + [self.pad_id] * (t - len(j.ids)) for j in group]
        pos = [list(range(start, start + t))] * len(group)
        self._forward(ids, pos, cache)
        for row, job in enumerate(group):
            self._collect(job, cache, row, spans, out)
        cache.free()

    def _collect(self, job: _Job, cache: SpliceCache, row: int, spans, out) -> None:
        off = job.prefix_tokens
        for i in job.pass_.spans[job.prefix :]:
            n = len(spans[i].token_ids)
            if i in job.pass_.targets:
                out[i] = self._read(cache, off, n, row)
            off += n

    def _read(self, cache: SpliceCache, off: int, n: int, row: int = 0) -> torch.Tensor:
        """Slots [off, off + n) of ``row`` as a new contiguous [L, 2, H, n, D] in the stored dtype (one copy)."""
        view = cache.buf[:, :, row, :, off : off + n]
        out = torch.empty(view.shape, dtype=self.out_dtype, device=view.device)
        return out.copy_(view)

    def _forward(self, ids: list[list[int]], pos: list[list[int]], cache: SpliceCache) -> None:
        ids_t = torch.tensor(ids, dtype=torch.long, device=self.device)
        pos_t = torch.tensor(pos, dtype=torch.long, device=self.device)
        self.runner.forward(ids_t, pos_t, cache)


def _libc():
    name = ctypes.util.find_library("c")
    try:
        return ctypes.CDLL(name) if name else None
    except OSError:
        return None


_LIBC = _libc()


def release_free_memory(device: torch.device) -> None:
    """Give freed heap pages back to the OS (glibc ``malloc_trim``; a no-op elsewhere and on GPU).
    Without it freed encoding buffers and per-forward activations stay resident in glibc's arenas."""
    trim = getattr(_LIBC, "malloc_trim", None)
    if device.type == "cpu" and trim is not None:
        trim(0)


def _common_prefix(a, b) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def _offsets(lengths: list[int]) -> list[int]:
    out, acc = [], 0
    for n in lengths:
        out.append(acc)
        acc += n
    out.append(acc)
    return out


def _cat(spans, indices, what: str) -> list[int]:
    if what == "ids":
        return [t for i in indices for t in spans[i].token_ids]
    return [p for i in indices for p in range(spans[i].start, spans[i].end)]
