"""One attention call a layer over keys gathered from the pool by slot (serving_core/dense.py).

Without the native CPU kernel (the path a GPU takes) a step's rows are attended in one padded call
a layer. It must compute what the per-part path computes (each shared segment, each earlier part
and the causal chunk as separate calls merged by log-sum-exp, itself held to plain softmax
attention in test_serving.py): decode rows and chunks of different lengths in one step, segments
read shifted (rotary), segments some queries see a prefix of (selective recompute's rows), and a
store tensor outside the pool merged in afterwards.
"""

from __future__ import annotations

import logging

import pytest
import torch

from promptcache import tunables
from promptcache.engine.serving_core import paged
from promptcache.engine.serving_core.dense import pool_run, run_slots
from promptcache.engine.serving_core.kvpool import KVPool
from promptcache.models.splice import KVSpec


def make_pool(seed: int, head_dim: int = 16, dtype: torch.dtype = torch.float32) -> KVPool:
    g = torch.Generator().manual_seed(seed)
    pool = KVPool(KVSpec(layers=2, kv_heads=2, head_dim=head_dim, dtype=dtype), torch.device("cpu"),
                  tokens=1024, block_size=4)
    pool.buf.copy_(torch.randn(pool.buf.shape, generator=g))
    return pool


def both(pool, rows, query, monkeypatch, rope=None):
    """(dense result, per-part result) of layer 1 for ``rows``, and the dense plan."""
    monkeypatch.setattr(paged.cpu_attention, "gathers", lambda buf: False)
    plan = paged.build_plan(pool, rows, rope=rope)
    assert plan.dense is not None
    got = paged.attend(plan, 1, query)
    monkeypatch.setattr(tunables, "DENSE_MAX", 0)
    per_part = paged.build_plan(pool, rows, rope=rope)
    assert per_part.dense is None
    return got, paged.attend(per_part, 1, query), plan


def rows_of(pool, shifts=(0, 0), limits=False, store=None):
    """Two shared pool segments (and ``store``, a tensor of its own, after them), then: a decode row,
    a chunk of 5 with earlier tokens, a chunk of 3. ``limits``: the chunks' query i sees the first
    1 + i keys of the first segment (of ``store`` where given)."""
    segs = [pool.views(pool.allocate(2), n)[0] for n in (6, 5)]
    shared = [(f"s{i}", v) for i, v in enumerate(segs)]
    if store is not None:
        shared.append(("store", store))
    own = [pool.slots(pool.allocate(3), 0, n) for n in (4, 9, 3)]
    out = []
    for own_slots, t in zip(own, (1, 5, 3)):
        lim = None
        if limits and t > 1:  # query i sees the first segment's first 1 + i keys (prompt order)
            seen = torch.arange(1, t + 1).clamp(max=4)
            lim = [None, None, seen] if store is not None else [seen, None]
        out.append(paged.PagedRow([0] * t, list(range(t)), shared, own_slots, shared_limits=lim,
                                  shared_shift=list(shifts) + ([0] if store is not None else [])))
    return out


@pytest.mark.parametrize("case", ["plain", "shifted", "limits", "store-tensor", "store-limited"])
def test_one_padded_call_equals_the_per_part_path(case, monkeypatch):
    pool = make_pool(seed=len(case))
    g = torch.Generator().manual_seed(7)
    store = torch.randn((2, 2, 2, 4, 16), generator=g) if case.startswith("store") else None
    rows = rows_of(pool, shifts=(3, 11) if case == "shifted" else (0, 0),
                   limits=case in ("limits", "store-limited"), store=store)
    rope = 1.0 / (10000 ** (torch.arange(0, 16, 2, dtype=torch.float32) / 16)) if case == "shifted" else None
    query = torch.randn((1, 6, 9, 16), generator=g)  # 6 query heads over 2 KV heads, 1 + 5 + 3 queries
    got, want, plan = both(pool, rows, query, monkeypatch, rope)
    assert (plan.dense.rows, plan.dense.queries) == (3, 5)
    # the store tensor (outside the pool) stays a cascade segment merged in afterwards
    assert bool(plan.segments) == case.startswith("store") and bool(plan.limited) == (case == "store-limited")
    assert got.shape == want.shape == (1, 9, 6, 16)
    assert torch.allclose(got, want, atol=1e-5, rtol=0), (got - want).abs().max()


@pytest.mark.parametrize("dtype, channels", [(torch.float32, 8), (torch.bfloat16, 16), (torch.bfloat16, 8)])
def test_the_layers_buffers_gather_widen_and_rotate_as_the_per_part_path(dtype, channels, monkeypatch):
    """A step's layers gather, widen (a pool not in float32) and rotate their keys in buffers made at
    the first layer (``DenseStep.work``): rotary over the first 8 of 16 channels (the rest copied)
    or all of them, each layer equal to the per-part path, and the same again when the buffers
    are reused (layer 0 after layer 1, then layer 1 again)."""
    pool = make_pool(seed=11, dtype=dtype)
    rows = rows_of(pool, shifts=(3, 11))
    rope = 1.0 / (10000 ** (torch.arange(0, channels, 2, dtype=torch.float32) / channels))
    query = torch.randn((1, 6, 9, 16), generator=torch.Generator().manual_seed(9))
    got, want, plan = both(pool, rows, query, monkeypatch, rope)
    assert plan.dense.swap == (channels == 16) and len(plan.dense.work) == 1
    assert torch.allclose(got, want, atol=1e-5, rtol=0), (got - want).abs().max()
    per_part = paged.build_plan(pool, rows, rope=rope)  # DENSE_MAX is 0 now (``both``)
    assert torch.allclose(paged.attend(plan, 0, query), paged.attend(per_part, 0, query), atol=1e-5, rtol=0)
    assert torch.equal(paged.attend(plan, 1, query), got) and len(plan.dense.work) == 1


def test_one_padded_call_is_causal_attention_over_segments_then_own_tokens(monkeypatch):
    """Against softmax attention written out: query i of a chunk sees every shared key, its row's
    earlier tokens and its chunk's tokens 0..i; a decode row sees its segments and own tokens."""
    pool = make_pool(seed=3)
    rows = rows_of(pool)
    g = torch.Generator().manual_seed(5)
    query = torch.randn((1, 6, 9, 16), generator=g)
    monkeypatch.setattr(paged.cpu_attention, "gathers", lambda buf: False)
    got = paged.attend(paged.build_plan(pool, rows), 1, query)
    k_all, v_all = pool.buf[1, 0], pool.buf[1, 1]
    off = 0
    for row in rows:
        t = len(row.ids)
        seg_k = torch.cat([v[1, 0] for _, v in row.shared], dim=1)
        seg_v = torch.cat([v[1, 1] for _, v in row.shared], dim=1)
        done = len(row.own) - t
        for i in range(t):
            own = row.own[: done + i + 1]
            k = torch.cat([seg_k, k_all[:, own]], dim=1)
            v = torch.cat([seg_v, v_all[:, own]], dim=1)
            q = query[0, :, off + i].view(2, 3, 16)
            want = torch.softmax(q @ k.transpose(1, 2) / 4, dim=-1) @ v
            assert torch.allclose(got[0, off + i], want.reshape(6, 16), atol=1e-5, rtol=0)
        off += t


def test_a_step_too_large_to_pad_in_one_call_is_split_in_groups(monkeypatch, caplog):
    """Past ``DENSE_MAX`` for the whole step, the rows go in groups that each fit (the decode row
    alone, the two chunks together), a call a group, computing what the per-part path computes;
    only where one row alone exceeds it does the step keep the per-part path (logged)."""
    pool = make_pool(seed=1)
    rows = rows_of(pool, shifts=(0, 7))
    rope = 1.0 / (10000 ** (torch.arange(0, 16, 2).float() / 16))
    query = torch.randn(1, 6, 9, 16, generator=torch.Generator().manual_seed(5))
    monkeypatch.setattr(paged.cpu_attention, "gathers", lambda buf: False)
    monkeypatch.setattr(tunables, "DENSE_MAX", 2 * 3 * 5 * 20)  # KV heads x rows x queries x keys: one call
    assert paged.build_plan(pool, rows, rope=rope).dense is not None
    monkeypatch.setattr(tunables, "DENSE_MAX", 2 * 3 * 5 * 20 - 1)
    plan = paged.build_plan(pool, rows, rope=rope)
    assert plan.dense is None and [idx.tolist() for _, idx in plan.dense_parts] == [[0], list(range(1, 9))]
    assert [(s.rows, s.queries, s.width) for s, _ in plan.dense_parts] == [(1, 1, 15), (2, 5, 20)]
    got = paged.attend(plan, 1, query)
    monkeypatch.setattr(tunables, "DENSE_MAX", 2 * 5 * 20 - 1)  # the chunk of 5 alone is 2 x 5 x 20
    with caplog.at_level(logging.INFO, logger="promptcache.engine.serving_core.dense"):
        per_part = paged.build_plan(pool, rows, rope=rope)
    assert per_part.dense is None and not per_part.dense_parts and per_part.prefills and "part by part" in caplog.text
    assert torch.allclose(got, paged.attend(per_part, 1, query), atol=1e-5, rtol=0)


def test_dense_groups_keep_decode_rows_apart_and_fill_each_group_up_to_the_bound():
    from promptcache.engine.serving_core.dense import dense_groups

    queries, keys = [1, 1, 30, 1, 10, 20], [50, 60, 80, 40, 70, 90]
    assert dense_groups(queries, keys, 2, 10**9) == [list(range(6))]  # fits: one call
    # decode rows first (2 x 3 x 1 x 60 = 360), then the prefill rows by falling queries: the row of 30
    # (2 x 30 x 80 = 4,800) and the row of 20 would pad 2 x 2 x 30 x 90 = 10,800, the rows of 20 and
    # 10 together 2 x 2 x 20 x 90 = 7,200
    assert dense_groups(queries, keys, 2, 7200) == [[0, 1, 3], [2], [5, 4]]
    assert dense_groups(queries, keys, 2, 7199) == [[0, 1, 3], [2], [5], [4]]
    assert dense_groups(queries, keys, 2, 4799) is None  # the row of 30 queries alone exceeds it


def test_pool_run_of_a_view_and_of_a_tensor_of_its_own():
    pool = make_pool(seed=2)
    blocks = pool.allocate(3)
    view = pool.views(blocks, 10)[0]
    first, count = pool_run(pool.buf, view)
    assert list(range(first, first + count)) == pool.slots(blocks, 0, 10).tolist()
    assert pool_run(pool.buf, view.clone()) is None
    assert pool_run(pool.buf, pool.buf[:, :, :1, 0:4]) is None  # not every head: not a run of slots
    assert pool_run(pool.buf, pool.buf[:, :, :, 1:5, :8]) is None  # not every channel


def test_slot_runs_and_run_slots_build_what_the_slot_tensors_hold():
    pool = make_pool(seed=3)
    a, b = pool.allocate(2), pool.allocate(1)
    blocks = [b[0], a[1], a[0]]  # out of order: three runs
    assert pool.slot_runs(blocks, 10) == [(b[0] * 4, 4), (a[1] * 4, 4), (a[0] * 4, 2)]
    for n in (0, 1, 4, 5, 12):
        got = [s for first, k in pool.slot_runs(blocks, n) for s in range(first, first + k)]
        assert got == pool.slots(blocks, 0, n).tolist()
    with pytest.raises(ValueError, match="3 blocks of 4 tokens cannot hold 13 tokens"):
        pool.slot_runs(blocks, 13)
    rows = [[(8, 3), (40, 2)], [], [(0, 0), (17, 4)]]
    got = run_slots(rows, 6, torch.device("cpu"))
    assert got.tolist() == [8, 9, 10, 40, 41, 0] + [0] * 6 + [17, 18, 19, 20, 0, 0]


def test_rows_with_block_tables_build_the_same_step(monkeypatch):
    """A step whose rows carry their block tables and their segments' runs (``PagedRow.own_blocks``,
    ``shared_runs``, as the scheduler's do) builds its slots and write slots from Python ints: the
    same plan, the same attention."""
    pool = make_pool(seed=5)
    g = torch.Generator().manual_seed(3)
    segs = [pool.views(pool.allocate(2), n)[0] for n in (6, 5)]
    shared = [(f"s{i}", v) for i, v in enumerate(segs)]
    tables = [pool.allocate(1) + pool.allocate(2)[::-1] for _ in range(3)]  # runs out of order
    made = []
    for own_blocks in (None, True):
        rows = [paged.PagedRow([0] * t, list(range(t)), shared, pool.slots(blk, 0, n), shared_shift=[2, 0],
                               own_blocks=blk if own_blocks else None,
                               shared_runs=[pool_run(pool.buf, v) for v in segs] if own_blocks else None)
                for blk, n, t in zip(tables, (4, 9, 3), (1, 5, 3))]
        monkeypatch.setattr(paged.cpu_attention, "gathers", lambda buf: False)
        plan = paged.build_plan(pool, rows, rope=1.0 / (10000 ** (torch.arange(0, 16, 2) / 16)))
        made.append((plan, paged.step_inputs(pool, rows)))
    (plain, inputs), (tabled, tabled_inputs) = made
    assert torch.equal(plain.dense.slots, tabled.dense.slots) and torch.equal(plain.dense.mask, tabled.dense.mask)
    assert torch.equal(plain.dense.cos, tabled.dense.cos)
    assert torch.equal(inputs[2], tabled_inputs[2])
    query = torch.randn((1, 6, 9, 16), generator=g)
    assert torch.equal(paged.attend(plain, 1, query), paged.attend(tabled, 1, query))


def test_bad_key_limits_are_refused_with_what_is_wrong(monkeypatch):
    pool = make_pool(seed=4)
    rows = rows_of(pool, limits=True)
    rows[1].shared_limits[0] = torch.tensor([1, 2, 3, 4, 9])  # the segment holds 6 tokens
    monkeypatch.setattr(paged.cpu_attention, "gathers", lambda buf: False)
    with pytest.raises(ValueError, match=r"key limits of a shared segment of 6 tokens must lie in 0..6"):
        paged.build_plan(pool, rows)
