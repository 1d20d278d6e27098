"""Decode rows over documents read in place at any position, in one native call a layer.

The native gather op over runs (``attend_gather_runs``, kernels/attention.cpp) reads each decode
row's keys by slot from the pool or from a store's tensors, in runs, each run with the row's query
rotated back by the run's shift. It is held here to attention computed in float64 with every key's
query rotated as the per-segment path rotates it (``dense.rotation``/``rotate``), over rows that
share leading keys (the shared pass) and rows that do not, partial rotary, float32 and bfloat16;
``build_plan`` folds shifted pool segments and store tensors into decode rows' slot lists (one
attention call a layer), and the result equals the per-segment path (each document its own call,
queries rotated and merged by log-sum-exp) with the native kernel and without it. Bad input is
refused in a child process (tests/refusals.py).
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


@pytest.fixture(scope="module")
def op():
    require(*COMPILER)  # skipped, the packages named, without a compiler (failed under CI=true)
    assert cpu_attention.available(), cpu_attention.unavailable_reason()
    return cpu_attention.gather_runs_kernel_for(torch.zeros(1, 1, 1, 16), torch.zeros(1))


def rope_of(r: int) -> torch.Tensor:
    return 1.0 / (10000 ** (torch.arange(0, r, 2, dtype=torch.float32) / r))


def make_rows(gen, b, pool_n, sources, shifts, shared=None):
    """Rows of runs [(source, slots, shift)]: ``shared`` = (rows, keys, shift): the first rows begin
    with the same pool slots read at that shift (the shared pass); then 1-4 runs of random sources
    (-1: the pool) and shifts, then the row's own pool slots."""
    rows = []
    common = torch.randperm(pool_n, generator=gen)[: shared[1]].tolist() if shared else None
    for i in range(b):
        runs = [(-1, common, shared[2])] if shared and i < shared[0] else []
        for _ in range(int(torch.randint(1, 5, (1,), generator=gen))):
            src = int(torch.randint(-1, len(sources), (1,), generator=gen))
            n = pool_n if src < 0 else sources[src].shape[3]
            count = int(torch.randint(1, 90, (1,), generator=gen))
            runs.append((src, torch.randint(0, n, (count,), generator=gen).tolist(),
                         shifts[int(torch.randint(0, len(shifts), (1,), generator=gen))]))
        runs.append((-1, torch.randint(0, pool_n, (int(torch.randint(1, 40, (1,), generator=gen)),),
                                       generator=gen).tolist(), 0))
        rows.append(runs)
    return rows


def tables(rows, r):
    """slots, lengths, run_starts, run_src, run_rot, cos, sin, distinct shifts of ``rows`` (padding
    runs empty at the row's length)."""
    index: dict[int, int] = {}
    width = max(len(x) for x in rows)
    lengths = [sum(len(s) for _, s, _ in x) for x in rows]
    slots = torch.zeros(len(rows), max(lengths), dtype=torch.long)
    starts, src, rot = [], [], []
    for i, x in enumerate(rows):
        flat = [t for _, s, _ in x for t in s]
        slots[i, : len(flat)] = torch.tensor(flat)
        at = [0]
        for _, s, _ in x[:-1]:
            at.append(at[-1] + len(s))
        pad = width - len(x)
        starts.append(at + [lengths[i]] * pad)
        src.append([s for s, _, _ in x] + [-1] * pad)
        rot.append([index.setdefault(sh, len(index)) if sh else -1 for _, _, sh in x] + [-1] * pad)
    shifts = torch.tensor(list(index), dtype=torch.float64)
    cos, sin = rotation(-shifts, rope_of(r)) if index else (torch.zeros(0, 0), torch.zeros(0, 0))
    as_long = lambda v: torch.tensor(v, dtype=torch.long)  # noqa: E731
    return slots, as_long(lengths), as_long(starts), as_long(src), as_long(rot), cos, sin


def reference(q, kbuf, vbuf, sources, layer, rows, r, scale):
    """out [X, B, G, D], lse [X, B, G] in float64: every key scored with its run's query, rotated back
    by the run's shift as ``paged._rotated`` rotates queries (``dense.rotation``/``rotate``)."""
    x, b, g, d = q.shape
    rope = rope_of(r)
    out, lse = torch.zeros(x, b, g, d, dtype=torch.float64), torch.zeros(x, b, g, dtype=torch.float64)
    for i, runs in enumerate(rows):
        scores, values = [], []
        for src, slots, shift in runs:
            k = kbuf if src < 0 else sources[src][layer, 0]
            v = vbuf if src < 0 else sources[src][layer, 1]
            qr = q[:, i].double()
            if shift:
                cos, sin = rotation(-torch.tensor([float(shift)], dtype=torch.float64), rope)
                qr = rotate(qr, cos.double(), sin.double(), swap=False)
            idx = torch.tensor(slots)
            scores.append(qr @ k[:, idx].double().transpose(1, 2) * scale)  # [X, G, n]
            values.append(v[:, idx].double())
        s, vals = torch.cat(scores, -1), torch.cat(values, 1)
        out[:, i] = torch.softmax(s, -1) @ vals
        lse[:, i] = torch.logsumexp(s, -1)
    return out, lse


def close(got, want, tol=1e-5):
    (o, l), (ro, rl) = got, want
    assert o.dtype == torch.float32 and l.dtype == torch.float32
    assert (o.double() - ro).abs().max().item() < tol * max(1.0, ro.abs().max().item())
    assert (l.double() - rl).abs().max().item() < tol * max(1.0, rl.abs().max().item())


# g <= 8: each key read in place per row; g = 9: the row's tiles packed. shared: rows beginning
# with the same 200 pool keys (read once for all of them); at a shift: the shared pass rotates them
@pytest.mark.parametrize("b,g,d,r,shared", [(12, 3, 64, 64, None), (10, 3, 64, 16, (6, 200, 0)),
                                            (9, 1, 32, 32, (5, 300, 7)), (5, 9, 16, 8, (3, 150, 0)),
                                            (7, 4, 80, 40, (7, 260, 41))])
def test_runs_equal_attention_with_each_runs_query_rotated(op, b, g, d, r, shared):
    gen = torch.Generator().manual_seed(b * g + d + r)
    buf = torch.randn(2, 2, 3, 600, d, generator=gen)  # [L, 2, Hk, S, D], as the pool holds it
    kbuf, vbuf = buf[1, 0], buf[1, 1]
    whole = torch.randn(2, 2, 3, 300, d, generator=gen)
    sources = [whole[:, :, :, 40:250], torch.randn(2, 2, 3, 120, d, generator=gen)]  # a slice, a tensor
    rows = make_rows(gen, b, 600, sources, [0, 3, 17, 250, -5], shared)
    q = torch.randn(3, b, g, d, generator=gen) * 2
    slots, lengths, starts, src, rot, cos, sin = tables(rows, r)
    got = op(q, kbuf, vbuf, slots, lengths, d ** -0.5, starts, src, rot, cos, sin, sources, 1)
    close(got, reference(q, kbuf, vbuf, sources, 1, rows, r, d ** -0.5))


def document_rows(gen, b, pool_n, sources, docs, shifts):
    """Rows reading 2-3 of ``docs`` ((source, slots) each: documents of a store's tensors or the
    pool) in a random order at random shifts, a short prefix and their own pool slots around them."""
    rows = []
    for _ in range(b):
        runs = [(-1, list(range(5)), 0)]
        for d in torch.randperm(len(docs), generator=gen)[: int(torch.randint(2, 4, (1,), generator=gen))].tolist():
            runs.append((*docs[d], shifts[int(torch.randint(0, len(shifts), (1,), generator=gen))]))
        runs.append((-1, torch.randint(5, pool_n, (int(torch.randint(1, 60, (1,), generator=gen)),),
                                       generator=gen).tolist(), 0))
        rows.append(runs)
    return rows


# documents many rows read, anywhere in their slot lists and at any shift: read together (their
# rows' queries, each rotated by its own shift, over packed key tiles), merged with each row's rest
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("b,g,d", [(12, 3, 64), (20, 1, 32), (6, 9, 16), (3, 3, 64)])
def test_documents_many_rows_read_are_read_together(op, dtype, b, g, d):
    gen = torch.Generator().manual_seed(b * g + d)
    buf = (torch.randn(2, 2, 3, 500, d, generator=gen) * 2).to(dtype)
    sources = [(torch.randn(2, 2, 3, 130, d, generator=gen) * 2).to(dtype) for _ in range(2)]
    docs = [(0, list(range(0, 120))), (1, list(range(7, 130))), (0, list(range(120, 130)) + [3, 4]),
            (-1, list(range(300, 420)))]
    rows = document_rows(gen, b, 500, sources, docs, [0, 4, 33, 260])
    q = (torch.randn(3, b, g, d, generator=gen) * 2).to(dtype)
    slots, lengths, starts, src, rot, cos, sin = tables(rows, d)
    got = op(q, buf[0, 0], buf[0, 1], slots, lengths, d ** -0.5, starts, src, rot, cos, sin, sources, 0)
    want = reference(q.float(), buf[0, 0].float(), buf[0, 1].float(), [x.float() for x in sources], 0, rows, d,
                     d ** -0.5)
    if dtype == torch.float32:
        close(got, want)
    else:  # rotated queries of a group rounded to bfloat16 for bfloat16 products (as torch's path rounds them)
        assert (got[1].double() - want[1]).abs().max().item() < 3e-2
        assert (got[0].double() - want[0]).abs().max().item() < 2 ** -7 * buf.float().abs().max().item()


def test_rows_alike_in_slots_but_not_in_shift_are_not_read_together(op):
    """Two rows over the same 200 pool slots, one reading them shifted: the shared pass must not
    take them as one (their scores differ)."""
    gen = torch.Generator().manual_seed(3)
    buf = torch.randn(2, 2, 2, 400, 32, generator=gen)
    common = list(range(10, 210))
    rows = [[(-1, common, 0), (-1, [300, 301], 0)], [(-1, common, 9), (-1, [302], 0)],
            [(-1, common, 9), (-1, [303, 304, 305], 0)]]
    q = torch.randn(2, 3, 2, 32, generator=gen)
    slots, lengths, starts, src, rot, cos, sin = tables(rows, 32)
    got = op(q, buf[0, 0], buf[0, 1], slots, lengths, 0.2, starts, src, rot, cos, sin, [], 0)
    close(got, reference(q, buf[0, 0], buf[0, 1], [], 0, rows, 32, 0.2))


@pytest.mark.parametrize("shared", [None, (6, 200, 0), (6, 200, 13)])
def test_bfloat16_queries_over_a_bfloat16_pool_and_store(op, shared):
    """A bfloat16 model's queries: each row's own pass widens them (rotated in float32), the shared
    pass rotates them in float32 and rounds them to bfloat16 (as torch's .to(bfloat16)) for
    bfloat16 products; within the probabilities' rounding of the float64 reference."""
    gen = torch.Generator().manual_seed(11)
    buf = (torch.randn(2, 2, 3, 600, 64, generator=gen) * 2).bfloat16()
    sources = [(torch.randn(2, 2, 3, 200, 64, generator=gen) * 2).bfloat16()]
    rows = make_rows(gen, 8, 600, sources, [0, 5, 130], shared)
    q = (torch.randn(3, 8, 3, 64, generator=gen) * 2).bfloat16()
    slots, lengths, starts, src, rot, cos, sin = tables(rows, 64)
    out, lse = op(q, buf[0, 0], buf[0, 1], slots, lengths, 0.125, starts, src, rot, cos, sin, sources, 0)
    ro, rl = reference(q.float(), buf[0, 0].float(), buf[0, 1].float(), [s.float() for s in sources], 0, rows, 64,
                       0.125)
    # the shared pass's rotated queries are rounded to bfloat16: scores within that rounding
    assert (lse.double() - rl).abs().max().item() < (2e-2 if shared and shared[2] else 1e-4)
    assert (out.double() - ro).abs().max().item() < 2 ** -7 * buf.float().abs().max().item()


def test_plain_runs_equal_the_gather_op(op):
    """Runs of pool keys read as they are: what attend_gather computes over the same slots."""
    gen = torch.Generator().manual_seed(5)
    buf = torch.randn(2, 2, 3, 700, 64, generator=gen)
    rows = make_rows(gen, 16, 700, [], [0], (10, 300, 0))
    q = torch.randn(3, 16, 3, 64, generator=gen)
    slots, lengths, starts, src, rot, cos, sin = tables(rows, 64)
    got = op(q, buf[1, 0], buf[1, 1], slots, lengths, 0.125, starts, src, rot, cos, sin, [], 1)
    want = cpu_attention.gather_kernel_for(q, buf)(q, buf[1, 0], buf[1, 1], slots, lengths, 0.125)
    assert (got[0] - want[0]).abs().max().item() < 1e-5 and (got[1] - want[1]).abs().max().item() < 1e-5


SETUP = ("import torch\nfrom promptcache.kernels import attention as c\n"
         "op = c.gather_runs_kernel_for(torch.zeros(1, 1, 1, 16), torch.zeros(1))\n"
         "q, k = torch.randn(1, 2, 1, 16), torch.randn(1, 10, 16)\n"
         "src = [torch.randn(2, 2, 1, 6, 16)]\n"
         "slots, lengths = torch.tensor([[0, 1, 2], [9, 5, 0]]), torch.tensor([3, 2])\n"
         "st, sr, ro = torch.tensor([[0, 2], [0, 1]]), torch.tensor([[-1, 0], [-1, -1]]), torch.tensor([[-1, 0], [0, -1]])\n"
         "cos = sin = torch.ones(1, 8)\n")


def test_bad_runs_are_refused_with_what_is_wrong(op):
    refused_in_child(SETUP, [
        ("op(q, k, k, slots, lengths, 1.0, torch.tensor([[1, 2], [0, 1]]), sr, ro, cos, sin, src, 0)",
         "row 0's first run starts at 1"),
        ("op(q, k, k, slots, lengths, 1.0, torch.tensor([[0, 2], [0, 3]]), sr, ro, cos, sin, src, 0)",
         "row 1 run 0 starts at 0 .*at most at the row's length 2"),
        ("op(q, k, k, slots, lengths, 1.0, st, sr, torch.tensor([[-1, 1], [0, -1]]), cos, sin, src, 0)",
         "row 0 run 1 reads rotation 1 .cos and sin hold 1"),
        ("op(q, k, k, slots, lengths, 1.0, st, torch.tensor([[-1, 1], [-1, -1]]), ro, cos, sin, src, 0)",
         "row 0 run 1 reads source 1 .1 sources"),
        ("op(q, k, k, torch.tensor([[0, 1, 6], [9, 5, 0]]), lengths, 1.0, st, sr, ro, cos, sin, src, 0)",
         "row 0 slot 6 is outside the 6 slots of its source"),
        ("op(q, k, k, torch.tensor([[0, 1, 2], [10, 5, 0]]), lengths, 1.0, st, sr, ro, cos, sin, src, 0)",
         "row 1 slot 10 is outside the 10 slots of k and v"),
        ("op(q, k, k, slots, lengths, 1.0, st, sr, ro, cos, sin, src, 2)", r"sources\[0\] must be .* L > layer 2"),
        ("op(q, k, k, slots, lengths, 1.0, st, sr, ro, cos, sin, [src[0].bfloat16()], 0)", r"sources\[0\] must be Float"),
        ("op(q, k, k, slots, lengths, 1.0, st, sr, ro, torch.ones(1, 18), torch.ones(1, 18), src, 0)",
         "the rotary width r = 18"),
        ("op(q, k, k, slots, lengths, 1.0, st, sr, ro, cos, torch.ones(1, 6), src, 0)", "cos and sin must be"),
        ("op(q, k, k, slots, lengths, 1.0, st.int(), sr, ro, cos, sin, src, 0)", "run_starts, run_src and run_rot must"),
        ("op(q, k, k, slots, lengths, 1.0, st[:1], sr[:1], ro[:1], cos, sin, src, 0)", r"\[B, R\], B = 2")])


def rows_over_documents(pool, gen, chunk=False, values=torch.float32, limited=None):
    """Decode rows over a prompt prefix held in the pool (not shifted), then documents in a random
    order at positions where they were not stored: two held in the pool, two store tensors (one
    cut in two by recompute: slices of one tensor), then own tokens; ``chunk``: a prefill chunk of
    3 beside them reading the same documents. ``limited`` (not None): the first four rows prefill
    chunks instead (2-6 tokens after 0-5 earlier own tokens), the fifth a decode row; True: each
    chunk sees each document up to a non-decreasing prefix (selective recompute's rows)."""
    prefix = pool.allocate(3)  # 12 tokens
    docs = [pool.allocate(2), pool.allocate(3)]  # 8 and 12 tokens
    as_pool = lambda x: x.to(values).to(pool.buf.dtype)  # noqa: E731 (values: the precision they hold)
    store = as_pool(torch.randn(2, 2, 2, 20, pool.buf.shape[-1], generator=gen))
    views = [pool.views(d, 4 * len(d))[0] for d in docs]
    held = [(f"pool{i}", v, pool.slots(d, 0, v.shape[3])) for i, (d, v) in enumerate(zip(docs, views))]
    kept = [("store", store[:, :, :, :9], None), ("store[11:]", store[:, :, :, 11:], None),
            ("other", as_pool(torch.randn(2, 2, 2, 7, pool.buf.shape[-1], generator=gen)), None)]
    rows = []
    for i in range(5 + chunk):
        if limited is None:
            t, done = (3 if chunk and i == 5 else 1), 5
        else:
            t = 1 if i == 4 else int(torch.randint(2, 7, (1,), generator=gen))
            done = 0 if i == 4 else int(torch.randint(0, 6, (1,), generator=gen))
        order = torch.randperm(5, generator=gen).tolist()
        parts = [("prefix", pool.views(prefix, 12)[0], pool.slots(prefix, 0, 12))] + [(held + kept)[j] for j in order]
        shifts = [0] + [int(torch.randint(-6, 40, (1,), generator=gen)) for _ in order]
        lims = None
        if limited and i < 4:
            lims = [None] + [torch.randint(0, v.shape[3] + 1, (t,), generator=gen).sort().values for _, v, _ in parts[1:]]
        own = pool.slots(pool.allocate(2 if limited is None else 3), 0, done + t)
        rows.append(paged.PagedRow([0] * t, list(range(t)), [(k, v) for k, v, _ in parts], own,
                                   shared_slots=[s for _, _, s in parts], shared_shift=shifts, shared_limits=lims))
    return rows


def attend_all(pool, rows, query, rope):
    plan = paged.build_plan(pool, rows, rope=rope)
    return [paged.attend(plan, layer, query) for layer in range(2)], plan


# rotary frequencies for every layer (partial: 8 of 16 channels rotate), and a row a layer (Gemma 3's
# bases per layer type); decode rows alone (one call a layer) and beside a prefill chunk
@pytest.mark.parametrize("per_layer", [False, True])
@pytest.mark.parametrize("chunk", [False, True])
def test_decode_rows_over_shifted_documents_in_one_call_equal_the_per_segment_path(op, monkeypatch, per_layer, chunk):
    gen = torch.Generator().manual_seed(2 * per_layer + chunk)
    pool = KVPool(KVSpec(layers=2, kv_heads=2, head_dim=16, dtype=torch.float32), torch.device("cpu"),
                  tokens=256, block_size=4)
    pool.buf.copy_(torch.randn(pool.buf.shape, generator=gen))
    rope = torch.stack([rope_of(8), rope_of(8) / 7]) if per_layer else rope_of(8)
    rows = rows_over_documents(pool, gen, chunk)
    query = torch.randn((1, 6, 5 + 3 * chunk, 16), generator=gen)  # 3 query heads a KV head
    calls = {"runs": 0, "attend": 0}
    real_runs, real_attend = cpu_attention.gather_runs_kernel_for, cpu_attention.kernel_for

    def counted(name, real):
        def wrapper(*args):
            calls[name] += 1
            return real(*args)
        return wrapper

    monkeypatch.setattr(cpu_attention, "gather_runs_kernel_for", counted("runs", real_runs))
    monkeypatch.setattr(cpu_attention, "kernel_for", counted("attend", real_attend))
    got, plan = attend_all(pool, rows, query, rope)
    assert plan.decode_runs is not None and len(plan.decode_runs.sources) == 2  # the store tensor, the other
    assert calls["runs"] == 2  # one gather a layer for every decode row's documents
    if not chunk:  # nothing else: every segment folded
        assert not plan.segments and not plan.limited and calls["attend"] == 0
    monkeypatch.setattr(paged, "FOLD_SHARED", False)  # the per-segment path: a call per document group
    per_segment, old = attend_all(pool, rows, query, rope)
    assert old.decode_runs is None and old.segments
    monkeypatch.setattr(cpu_attention, "available", lambda: False)  # ... on torch's kernels
    monkeypatch.setattr(tunables, "DENSE_MAX", 0)
    on_torch, plain = attend_all(pool, rows, query, rope)
    assert plain.dense is None and plain.decode_runs is None
    for a, b, c in zip(got, per_segment, on_torch):
        assert (a - b).abs().max().item() < 1e-5, (a - b).abs().max()
        assert (a - c).abs().max().item() < 1e-5, (a - c).abs().max()


def test_bfloat16_decode_rows_over_shifted_documents_stay_within_rounding(op, monkeypatch):
    """A bfloat16 model's decode rows over a bfloat16 pool and store: the fold (queries widened and
    rotated in float32 in each row's pass) is as close to the same attention in float32 (over the
    same bfloat16 values) as the per-segment path (rotated queries rounded to bfloat16, bfloat16
    products, partial results merged), within bfloat16's rounding."""
    pools = []
    for dtype in (torch.bfloat16, torch.float32):
        pool = KVPool(KVSpec(layers=2, kv_heads=2, head_dim=16, dtype=dtype), torch.device("cpu"), tokens=256,
                      block_size=4)
        pool.buf.copy_(torch.randn(pool.buf.shape, generator=torch.Generator().manual_seed(9)).bfloat16())
        pools.append((pool, rows_over_documents(pool, torch.Generator().manual_seed(4), values=torch.bfloat16)))
    query = torch.randn((1, 6, 5, 16), generator=torch.Generator().manual_seed(1)).bfloat16()
    rope = rope_of(16)
    (pool, rows), (pool32, rows32) = pools
    got, plan = attend_all(pool, rows, query, rope)
    assert plan.decode_runs is not None and not plan.segments
    want, _ = attend_all(pool32, rows32, query.float(), rope)  # float32 throughout, the values as stored
    monkeypatch.setattr(paged, "FOLD_SHARED", False)
    old, _ = attend_all(pool, rows, query, rope)
    for a, b, w in zip(got, old, want):
        err, err_old = (a.float() - w).abs().max().item(), (b.float() - w).abs().max().item()
        assert err < 2 ** -7 * w.abs().max().item(), err
        assert err <= err_old + 2 ** -9 * w.abs().max().item(), (err, err_old)


DOCS = {
    "paris": "Paris is the capital of France, famous for museums and cafes.",
    "tokyo": "Tokyo is a huge city in Japan with temples, food markets and fast trains.",
    "rome": "Rome is an old city with a famous tower and quiet gardens.",
}


def shifted_decodes(plan, rows) -> bool:
    """Whether the step's decode rows read shifted runs."""
    return plan.decode_runs is not None and plan.decode_runs.shifts.numel() > 0


def serve_questions(pc, store, monkeypatch, fold: bool, flag: str = "FOLD_SHARED", seen=shifted_decodes,
                    recomputes=(0.0, "auto")):
    """Questions over the documents in three orders (splice, at each of ``recomputes``), served
    together with ``paged``'s ``flag`` set to ``fold``: (greedy tokens, each step's logits,
    ``seen(plan, rows)`` of each step's plan)."""
    from promptcache.engine.decoding.sampling import SamplingParams
    from promptcache.engine.serving_core.request import Request
    from promptcache.engine.serving_core.scheduler import ServingScheduler

    monkeypatch.setattr(paged, flag, fold)
    logits, records = [], []
    build = paged.build_plan

    def recorded_plan(pool, rows, *args, **kwargs):
        plan = build(pool, rows, *args, **kwargs)
        records.append(seen(plan, rows))
        return plan

    def forward(pool, rows):
        out = paged.paged_forward(pc.runner, pool, rows)
        logits.append(out.float().clone())
        return out

    monkeypatch.setattr(paged, "build_plan", recorded_plan)
    sched = ServingScheduler(pc.runner, KVPool(pc.runner.spec, pc.device, 2048, 16), token_budget=512,
                             planner=pc.core.planner, forward=forward)
    orders = [["paris", "tokyo", "rome"], ["rome", "paris", "tokyo"], ["tokyo", "rome", "paris"]]
    reqs = [Request(store.prompt("Which city is old?", ids, recompute=r),
                    SamplingParams(max_new_tokens=6, temperature=0.0), pc.tokenizer)
            for ids in orders for r in recomputes]
    for r in reqs:
        sched.add(r)
    while sched.has_work:
        sched.step()
    monkeypatch.setattr(paged, "build_plan", build)
    assert all(r.error is None for r in reqs), [r.error for r in reqs]
    return [r.token_ids for r in reqs], logits, records


def family_store(family: str):
    """(engine, independent DocumentStore holding DOCS) on a tiny model of ``family``
    (``gemma3_window6``: Gemma 3 with a 6-position sliding window)."""
    from promptcache import PromptCache
    from promptcache.rag import DocumentStore
    from tiny import gemma3_model, make_model, make_tokenizer

    model = gemma3_model(6) if family == "gemma3_window6" else make_model(family)
    pc = PromptCache(model, make_tokenizer())
    store = DocumentStore(pc, independent=True)
    for k, v in DOCS.items():
        store.add(k, v)
    return pc, store


# served end to end: documents read in place at another position than they were stored at; rotary
# (Llama), partial rotary (GPT-NeoX, a quarter of the channels), a base per layer type (Gemma 3,
# window past every prompt), query norms (Qwen3). A sliding window the rows reach past (Gemma 3 with
# a 6-position window) keeps the keyed path (a bias per key position): no runs there, the same answers
@pytest.mark.parametrize("family", ["llama", "gpt_neox", "gemma3_text", "qwen3", "gemma3_window6"])
def test_served_decode_rows_over_shifted_documents_equal_the_per_segment_path(op, family, monkeypatch):
    pc, store = family_store(family)
    tokens, logits, shifted = serve_questions(pc, store, monkeypatch, fold=True)
    assert any(shifted) == (family != "gemma3_window6")  # decode rows read documents shifted, in runs
    want_tokens, want_logits, old = serve_questions(pc, store, monkeypatch, fold=False)
    assert not any(old)
    assert tokens == want_tokens
    assert len(logits) == len(want_logits)
    for a, b in zip(logits, want_logits):
        assert (a - b).abs().max().item() <= 1e-4, (a - b).abs().max()
