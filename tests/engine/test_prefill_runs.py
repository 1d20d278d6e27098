"""Prefill rows over documents read in place at any position, in one native call a layer.

The native prefill op over runs (``attend_prefill_runs``, kernels/attention.cpp) reads each prefill
row's keys by slot from the pool or from a store's tensors, in runs, each run with the query
rotated back by the run's shift, every query seeing a prefix of each run (selective recompute's
key limits in prompt order; causal over the row's own tokens), one online softmax over all runs.
It is held here to attention computed in float64; ``build_plan`` folds a prefill row's segments
and own tokens into one run table (``decode_runs.PrefillRuns``), and the result equals the
per-segment path (each document its own call, limited segments apart, merged by log-sum-exp)
with the native kernel and without it, at recompute 0 and with rows of key limits, served end to
end on every rotary family. Bad input is refused in a child process (tests/refusals.py).
"""

from __future__ import annotations

import pytest
import torch

from programs import COMPILER, require
from promptcache import tunables
from promptcache.engine.serving_core import paged
from promptcache.engine.serving_core.dense import rotate, rotation
from promptcache.engine.serving_core.kvpool import KVPool
from promptcache.kernels import attention as cpu_attention
from promptcache.models.splice import KVSpec
from refusals import refused_in_child
from test_gather_runs import attend_all, family_store, rope_of, rows_over_documents, serve_questions, tables


@pytest.fixture(scope="module")
def op():
    require(*COMPILER)  # skipped, the packages named, without a compiler (failed under CI=true)
    assert cpu_attention.available(), cpu_attention.unavailable_reason()
    return cpu_attention.prefill_runs_kernel_for(torch.zeros(1, 1, 1, 16), torch.zeros(1))


def prefill_rows(gen, b, pool_n, sources, shifts):
    """Rows of runs [(source, slots, shift)] (1-4 documents of random sources and shifts, then the
    row's own pool slots) with t queries each and each query's limit per run: documents seen up to
    a non-decreasing prefix (some not at all, some whole), own tokens causal."""
    rows, limits = [], []
    for _ in range(b):
        runs = []
        for _ in range(int(torch.randint(1, 5, (1,), generator=gen))):
            src = int(torch.randint(-1, len(sources), (1,), generator=gen))
            n = pool_n if src < 0 else sources[src].shape[3]
            count = int(torch.randint(1, 150, (1,), generator=gen))
            runs.append((src, torch.randint(0, n, (count,), generator=gen).tolist(),
                         shifts[int(torch.randint(0, len(shifts), (1,), generator=gen))]))
        t = int(torch.randint(1, 70, (1,), generator=gen))
        done = int(torch.randint(0, 30, (1,), generator=gen))
        runs.append((-1, torch.randint(0, pool_n, (done + t,), generator=gen).tolist(), 0))
        cols = []
        for _, slots, _ in runs[:-1]:
            kind = int(torch.randint(0, 3, (1,), generator=gen))
            if kind == 0:  # every query sees the whole document
                cols.append(torch.full((t,), len(slots)))
            else:  # a non-decreasing prefix (recompute's prompt order), 0 for the first queries where kind 2
                low = 0 if kind == 2 else 1
                cols.append(torch.randint(low, len(slots) + 1, (t,), generator=gen).sort().values)
        cols.append(torch.arange(done + 1, done + t + 1))
        rows.append(runs)
        limits.append(torch.stack(cols, 1))
    return rows, limits


def prefill_tables(rows, limits, r):
    """``tables`` of the rows, each query's row [M] and limits [M, R] (padding runs: 0)."""
    slots, lengths, starts, src, rot, cos, sin = tables(rows, r)
    width = starts.shape[1]
    lim = torch.cat([torch.nn.functional.pad(x, (0, width - x.shape[1])) for x in limits]).long()
    row = torch.cat([torch.full((x.shape[0],), i, dtype=torch.long) for i, x in enumerate(limits)])
    return slots, lengths, starts, src, rot, cos, sin, row, lim.contiguous()


def reference(q, kbuf, vbuf, sources, layer, rows, limits, r, scale, rounded: bool = False):
    """out [X, G, M, D], lse [X, G, M] in float64: each query's keys, every run's up to its limit,
    scored with the query rotated back by the run's shift (``dense.rotation``/``rotate``);
    ``rounded``: each rotated query rounded to bfloat16 (what bfloat16 products read)."""
    x, g, m, d = q.shape
    rope = rope_of(r)
    out, lse = torch.zeros(x, g, m, d, dtype=torch.float64), torch.zeros(x, g, m, dtype=torch.float64)
    qi = 0
    for runs, lim in zip(rows, limits):
        for j in range(lim.shape[0]):
            scores, values = [], []
            for (src, slots, shift), n in zip(runs, lim[j].tolist()):
                if n == 0:
                    continue
                k = kbuf if src < 0 else sources[src][layer, 0]
                v = vbuf if src < 0 else sources[src][layer, 1]
                qr = q[:, :, qi].double()  # [X, G, D]
                if shift:
                    cos, sin = rotation(-torch.tensor([float(shift)], dtype=torch.float64), rope)
                    qr = rotate(qr, cos.double(), sin.double(), swap=False)
                    qr = qr.to(torch.bfloat16).double() if rounded else qr
                idx = torch.tensor(slots[:n])
                scores.append(qr @ k[:, idx].double().transpose(1, 2) * scale)  # [X, G, n]
                values.append(v[:, idx].double())
            s, vals = torch.cat(scores, -1), torch.cat(values, 1)
            out[:, :, qi] = torch.softmax(s, -1) @ vals
            lse[:, :, qi] = torch.logsumexp(s, -1)
            qi += 1
    return out, lse


# g = 1, 3 (16 queries a tile), 9 (5 queries a tile), 64 (> a tile's 48 rows: heads split); partial
# rotary (r < d); float32 and bfloat16 pools and store tensors, float32 and bfloat16 queries
@pytest.mark.parametrize("b,g,d,r", [(5, 3, 64, 64), (4, 1, 32, 16), (3, 9, 16, 8), (2, 64, 16, 16),
                                     (4, 4, 80, 40)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prefill_runs_equal_attention_with_limits_and_rotations(op, b, g, d, r, dtype):
    gen = torch.Generator().manual_seed(b * g + d + r)
    buf = (torch.randn(2, 2, 3, 600, d, generator=gen) * 2).to(dtype)  # [L, 2, Hk, S, D]
    whole = (torch.randn(2, 2, 3, 300, d, generator=gen) * 2).to(dtype)
    sources = [whole[:, :, :, 40:250], (torch.randn(2, 2, 3, 160, d, generator=gen) * 2).to(dtype)]
    rows, limits = prefill_rows(gen, b, 600, sources, [0, 3, 17, 250, -5])
    m = sum(x.shape[0] for x in limits)
    q = (torch.randn(3, g, m, d, generator=gen) * 2).to(dtype)
    slots, lengths, starts, src, rot, cos, sin, row, lim = prefill_tables(rows, limits, r)
    out, lse = op(q, buf[1, 0], buf[1, 1], slots, lengths, d ** -0.5, starts, src, rot, cos, sin, sources, 1, row, lim)
    assert out.shape == (3, g, m, d) and lse.shape == (3, g, m) and out.dtype == lse.dtype == torch.float32
    ro, rl = reference(q.float(), buf[1, 0].float(), buf[1, 1].float(), [s.float() for s in sources], 1, rows,
                       limits, r, d ** -0.5)
    if dtype == torch.float32:  # float32 products and sums: float32's rounding
        assert (out.double() - ro).abs().max().item() < 1e-5 * max(1.0, ro.abs().max().item())
        assert (lse.double() - rl).abs().max().item() < 1e-5 * max(1.0, rl.abs().max().item())
    else:  # bfloat16 products where the CPU has them: the rotated queries and the probabilities rounded to
        # bfloat16; no further from the exact result than the rotated queries' rounding takes it, plus
        # the probabilities' rounding
        bo, bl = reference(q.float(), buf[1, 0].float(), buf[1, 1].float(), [s.float() for s in sources], 1, rows,
                           limits, r, d ** -0.5, rounded=True)
        vmax = buf.float().abs().max().item()
        err, base = (out.double() - ro).abs().max().item(), (bo - ro).abs().max().item()
        assert err <= 2 * base + 2 ** -8 * vmax, (err, base)
        err, base = (lse.double() - rl).abs().max().item(), (bl - rl).abs().max().item()
        assert err <= 2 * base + 1e-5 * max(1.0, rl.abs().max().item()), (err, base)


def test_queries_of_rows_out_of_order_and_a_query_seeing_no_key(op):
    """Rows' queries interleaved (tiles cut where the row changes); a query whose limits are all 0
    gets 0 and a log-sum-exp of -inf (weight 0 in a merge)."""
    gen = torch.Generator().manual_seed(7)
    buf = torch.randn(2, 2, 2, 100, 32, generator=gen)
    rows = [[(-1, list(range(10, 40)), 4), (-1, [50, 51, 52], 0)], [(-1, list(range(60, 90)), 0), (-1, [91, 92], 0)]]
    slots, lengths, starts, src, rot, cos, sin = tables(rows, 32)
    row = torch.tensor([0, 1, 0, 1, 0])
    lim = torch.tensor([[5, 1], [30, 1], [7, 2], [0, 2], [0, 0]])
    q = torch.randn(2, 2, 5, 32, generator=gen)
    out, lse = op(q, buf[0, 0], buf[0, 1], slots, lengths, 0.3, starts, src, rot, cos, sin, [], 0, row, lim)
    by_row = [[0, 2, 4], [1, 3]]
    for r, queries in enumerate(by_row):
        ro, rl = reference(q[:, :, queries[:2]], buf[0, 0], buf[0, 1], [], 0, [rows[r]], [lim[queries[:2]]], 32, 0.3)
        assert (out[:, :, queries[:2]].double() - ro).abs().max().item() < 1e-5
        assert (lse[:, :, queries[:2]].double() - rl).abs().max().item() < 1e-5
    assert out[:, :, 4].abs().max().item() == 0 and bool((lse[:, :, 4] == float("-inf")).all())


SETUP = ("import torch\nfrom promptcache.kernels import attention as c\n"
         "op = c.prefill_runs_kernel_for(torch.zeros(1, 1, 1, 16), torch.zeros(1))\n"
         "q, k = torch.randn(1, 1, 3, 16), torch.randn(1, 10, 16)\n"
         "src = [torch.randn(2, 2, 1, 6, 16)]\n"
         "slots, lengths = torch.tensor([[0, 1, 2], [9, 5, 0]]), torch.tensor([3, 2])\n"
         "st, sr, ro = torch.tensor([[0, 2], [0, 1]]), torch.tensor([[-1, 0], [-1, -1]]), torch.tensor([[-1, 0], [0, -1]])\n"
         "cos = sin = torch.ones(1, 8)\n"
         "row, lim = torch.tensor([0, 0, 1]), torch.tensor([[2, 0], [2, 1], [1, 1]])\n")


def test_bad_prefill_runs_are_refused_with_what_is_wrong(op):
    refused_in_child(SETUP, [
        ("op(q, k, k, slots, lengths, 1.0, st, sr, ro, cos, sin, src, 0, row, torch.tensor([[2, 0], [3, 1], [1, 1]]))",
         "query 1 sees 3 keys of run 0 of row 0 .it holds 2"),
        ("op(q, k, k, slots, lengths, 1.0, st, sr, ro, cos, sin, src, 0, row, torch.tensor([[2, 0], [2, -1], [1, 1]]))",
         "query 1 sees -1 keys of run 1"),
        ("op(q, k, k, slots, lengths, 1.0, st, sr, ro, cos, sin, src, 0, torch.tensor([0, 2, 1]), lim)",
         r"query 1 is of row 2 .2 rows"),
        ("op(q, k, k, slots, lengths, 1.0, st, sr, ro, cos, sin, src, 0, row[:2], lim)", r"query_row must be .* M = 3"),
        ("op(q, k, k, slots, lengths, 1.0, st, sr, ro, cos, sin, src, 0, row, lim[:, :1].contiguous())",
         r"limits must be contiguous int64 \[M, R\] = \[3, 2\]"),
        ("op(q, k, k, slots, lengths, 1.0, st, sr, ro, cos, sin, src, 0, row, lim.int())", "limits must be"),
        ("op(q, k, k, slots, lengths, 1.0, torch.tensor([[1, 2], [0, 1]]), sr, ro, cos, sin, src, 0, row, lim)",
         "row 0's first run starts at 1"),
        ("op(q, k, k, torch.tensor([[0, 1, 2], [10, 5, 0]]), lengths, 1.0, st, sr, ro, cos, sin, src, 0, row, lim)",
         "row 1 slot 10 is outside the 10 slots of k and v"),
        ("op(q, k, k, slots, torch.tensor([3, 4]), 1.0, st, sr, ro, cos, sin, src, 0, row, lim)",
         r"row 1 has length 4 .slots hold 3"),
        ("op(q[0], k, k, slots, lengths, 1.0, st, sr, ro, cos, sin, src, 0, row, lim)", r"q must be \[X, G, M, D\]")])


# rotary frequencies for every layer (partial: 8 of 16 channels rotate), and a row a layer (Gemma 3's
# bases per layer type); prefill rows reading whole documents (recompute 0) and prefixes of them
@pytest.mark.parametrize("per_layer", [False, True])
@pytest.mark.parametrize("limited", [False, True])
def test_prefill_rows_over_shifted_documents_in_one_call_equal_the_per_segment_path(op, monkeypatch, per_layer,
                                                                                      limited):
    gen = torch.Generator().manual_seed(2 * per_layer + limited)
    pool = KVPool(KVSpec(layers=2, kv_heads=2, head_dim=16, dtype=torch.float32), torch.device("cpu"),
                  tokens=512, block_size=4)
    pool.buf.copy_(torch.randn(pool.buf.shape, generator=gen))
    rope = torch.stack([rope_of(8), rope_of(8) / 7]) if per_layer else rope_of(8)
    rows = rows_over_documents(pool, gen, limited=limited)
    n = sum(len(r.ids) for r in rows)
    query = torch.randn((1, 6, n, 16), generator=gen)  # 3 query heads a KV head
    calls = {"prefill": 0, "attend": 0, "limits": 0}
    real = {"prefill": cpu_attention.prefill_runs_kernel_for, "attend": cpu_attention.kernel_for,
            "limits": cpu_attention.limits_kernel_for}

    def counted(name):
        def wrapper(*args):
            calls[name] += 1
            return real[name](*args)
        return wrapper

    monkeypatch.setattr(cpu_attention, "prefill_runs_kernel_for", counted("prefill"))
    monkeypatch.setattr(cpu_attention, "kernel_for", counted("attend"))
    monkeypatch.setattr(cpu_attention, "limits_kernel_for", counted("limits"))
    got, plan = attend_all(pool, rows, query, rope)
    pr = plan.prefill_runs
    assert pr is not None and pr.query_row.shape[0] == n - 1  # every row's queries but the decode row's
    assert len(pr.runs.sources) == 2  # the store tensor, the other
    assert pr.limits.shape == (n - 1, 7)  # the prefix, five documents, own tokens: a run each
    assert not plan.prefills and not plan.segments and not plan.limited  # every segment folded
    assert calls == {"prefill": 2, "attend": 0, "limits": 0}  # one call a layer for every prefill row
    monkeypatch.setattr(paged, "FOLD_PREFILL", False)  # the per-segment path: a call per document and part
    per_segment, old = attend_all(pool, rows, query, rope)
    assert old.prefill_runs is None and old.prefills and (old.limited if limited else old.segments)
    monkeypatch.setattr(cpu_attention, "available", lambda: False)  # ... on torch's kernels
    monkeypatch.setattr(tunables, "DENSE_MAX", 0)
    on_torch, plain = attend_all(pool, rows, query, rope)
    assert plain.dense is None and plain.prefill_runs is None
    for a, b, c in zip(got, per_segment, on_torch):
        assert (a - b).abs().max().item() < 1e-5, (a - b).abs().max()
        assert (a - c).abs().max().item() < 1e-5, (a - c).abs().max()


def test_bfloat16_prefill_rows_stay_within_rounding(op, monkeypatch):
    """A bfloat16 model's prefill rows over a bfloat16 pool and store: the fold (queries rotated in
    float32 and rounded to bfloat16, bfloat16 products where the CPU has them) is as close to the
    same attention in float32 (over the same bfloat16 values) as the per-segment path, within
    bfloat16's rounding."""
    pools = []
    for dtype in (torch.bfloat16, torch.float32):
        pool = KVPool(KVSpec(layers=2, kv_heads=2, head_dim=16, dtype=dtype), torch.device("cpu"), tokens=512,
                      block_size=4)
        pool.buf.copy_(torch.randn(pool.buf.shape, generator=torch.Generator().manual_seed(9)).bfloat16())
        rows = rows_over_documents(pool, torch.Generator().manual_seed(4), values=torch.bfloat16, limited=True)
        pools.append((pool, rows))
    (pool, rows), (pool32, rows32) = pools
    n = sum(len(r.ids) for r in rows)
    query = torch.randn((1, 6, n, 16), generator=torch.Generator().manual_seed(1)).bfloat16()
    rope = rope_of(16)
    got, plan = attend_all(pool, rows, query, rope)
    assert plan.prefill_runs is not None and not plan.segments and not plan.limited
    want, _ = attend_all(pool32, rows32, query.float(), rope)  # float32 throughout, the values as stored
    monkeypatch.setattr(paged, "FOLD_PREFILL", False)
    old, _ = attend_all(pool, rows, query, rope)
    for a, b, w in zip(got, old, want):
        err, err_old = (a.float() - w).abs().max().item(), (b.float() - w).abs().max().item()
        assert err < 2 ** -7 * w.abs().max().item(), err
        assert err <= err_old + 2 ** -9 * w.abs().max().item(), (err, err_old)


def test_a_row_reading_no_document_keeps_the_causal_call(op, monkeypatch):
    """A prefill row without shared segments (a plain prompt's chunk) keeps the causal call (its
    key tiles packed once for every query tile, bfloat16 products), beside a row folded into runs;
    both equal the per-segment path."""
    gen = torch.Generator().manual_seed(6)
    pool = KVPool(KVSpec(layers=2, kv_heads=2, head_dim=16, dtype=torch.float32), torch.device("cpu"), tokens=128,
                  block_size=4)
    pool.buf.copy_(torch.randn(pool.buf.shape, generator=gen))
    doc = pool.allocate(2)
    rows = [paged.PagedRow([0] * 4, list(range(4)), [], pool.slots(pool.allocate(2), 0, 6)),
            paged.PagedRow([0] * 3, list(range(3)), [("doc", pool.views(doc, 8)[0])], pool.slots(pool.allocate(1), 0, 3),
                           shared_slots=[pool.slots(doc, 0, 8)], shared_shift=[5])]
    query = torch.randn((1, 4, 7, 16), generator=gen)
    got, plan = attend_all(pool, rows, query, rope_of(16))
    assert [p[:2] for p in plan.prefills] == [(0, 4)] and plan.prefill_runs.queries == slice(4, 7)
    monkeypatch.setattr(paged, "FOLD_PREFILL", False)
    want, old = attend_all(pool, rows, query, rope_of(16))
    assert old.prefill_runs is None and len(old.prefills) == 2
    for a, b in zip(got, want):
        assert (a - b).abs().max().item() < 1e-5


def test_a_float16_store_tensor_keeps_its_own_call(op, monkeypatch):
    """A store tensor the op cannot read in place (float16 beside a float32 pool) stays a segment
    of its own, merged after the folded rows' call."""
    pool = KVPool(KVSpec(layers=2, kv_heads=2, head_dim=16, dtype=torch.float32), torch.device("cpu"), tokens=64,
                  block_size=4)
    pool.buf.copy_(torch.randn(pool.buf.shape, generator=torch.Generator().manual_seed(2)))
    half = torch.randn(2, 2, 2, 6, 16).half()
    doc = pool.allocate(1)
    row = paged.PagedRow([0] * 3, [0, 1, 2], [("doc", pool.views(doc, 4)[0]), ("half", half)],
                         pool.slots(pool.allocate(1), 0, 3), shared_slots=[pool.slots(doc, 0, 4), None])
    query = torch.randn((1, 4, 3, 16), generator=torch.Generator().manual_seed(3))
    got, plan = attend_all(pool, [row], query, rope_of(16))
    assert plan.prefill_runs is not None and len(plan.segments) == 1  # the float16 tensor
    assert plan.prefill_runs.limits.tolist() == [[4, 1], [4, 2], [4, 3]]  # the pool's document, own tokens
    monkeypatch.setattr(paged, "FOLD_PREFILL", False)
    want, old = attend_all(pool, [row], query, rope_of(16))
    assert old.prefill_runs is None
    for a, b in zip(got, want):
        assert (a - b).abs().max().item() < 1e-5


def folded_rows(plan, rows) -> tuple[bool, bool]:
    """Whether the step's prefill rows were folded, and folded with rows of key limits."""
    folded = plan.prefill_runs is not None
    return folded, folded and any(r.shared_limits is not None and any(x is not None for x in r.shared_limits)
                                  for r in rows)


def serve(pc, store, monkeypatch, fold: bool):
    """``serve_questions`` at recompute 0, 0.5 and "auto", the prefill fold on or off."""
    tokens, logits, seen = serve_questions(pc, store, monkeypatch, fold, "FOLD_PREFILL", folded_rows,
                                           (0.0, 0.5, "auto"))
    return tokens, logits, [limited for _, limited in seen], [folded for folded, _ in seen]


# served end to end: questions' own tokens and recomputed tokens as prefill rows over documents
# read in place elsewhere; rotary (Llama), partial rotary (GPT-NeoX), a base per layer type (Gemma 3,
# window past every prompt), query norms (Qwen3). A sliding window the rows reach past (Gemma 3
# with a 6-position window) keeps the keyed path (a bias per key position): nothing folded there
@pytest.mark.parametrize("family", ["llama", "gpt_neox", "gemma3_text", "qwen3", "gemma3_window6"])
def test_served_prefill_rows_over_documents_equal_the_per_segment_path(op, family, monkeypatch):
    pc, store = family_store(family)
    tokens, logits, limited, folded = serve(pc, store, monkeypatch, fold=True)
    assert any(folded) == (family != "gemma3_window6")
    assert any(limited) == (family != "gemma3_window6")  # recomputed rows seeing prefixes of documents
    want_tokens, want_logits, _, old = serve(pc, store, monkeypatch, fold=False)
    assert not any(old)
    assert tokens == want_tokens
    assert len(logits) == len(want_logits)
    for a, b in zip(logits, want_logits):
        assert (a - b).abs().max().item() <= 1e-4, (a - b).abs().max()
