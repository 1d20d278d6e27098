"""A decode batch's plan kept across steps and grown in place (serving_core/dense.py, ``DecodePlans``).

Without the native CPU kernel (the path a GPU takes), the plan of a step whose rows are the last
step's requests one token further is the last one with each row's new key appended: it must
attend exactly as a plan built afresh for the same rows, across the rebuild when a row outgrows
its spare keys, with segments read shifted and a store tensor merged in; a batch whose
membership changed must get a plan built for it; and the scheduler's requests, served with kept
plans, must decode the oracle's tokens.
"""

from __future__ import annotations

import pytest
import torch

from promptcache.engine.serving_core import paged
from promptcache.engine.serving_core.dense import SPARE_KEYS, DecodePlans, pool_run
from promptcache.engine.serving_core.kvpool import KVPool
from promptcache.models.splice import KVSpec

ROPE = 1.0 / (10000 ** (torch.arange(0, 16, 2, dtype=torch.float32) / 16))


def make_pool(seed: int) -> KVPool:
    g = torch.Generator().manual_seed(seed)
    pool = KVPool(KVSpec(layers=2, kv_heads=2, head_dim=16, dtype=torch.float32), torch.device("cpu"),
                  tokens=2048, block_size=4)
    pool.buf.copy_(torch.randn(pool.buf.shape, generator=g))
    return pool


class Request:
    """What the scheduler holds of a decoding request: its block table, its segments and their runs
    (the same objects every step), and its own tokens so far."""

    def __init__(self, pool, shared, shifts, done: int):
        self.pool, self.shared, self.shifts, self.done = pool, shared, shifts, done
        self.blocks = pool.allocate(1) + pool.allocate(12)[::-1]  # a block table of runs out of order
        self.slots = pool.slots(self.blocks, 0, len(self.blocks) * pool.block_size)
        self.runs = [pool_run(pool.buf, v) for _, v in shared]

    def row(self) -> paged.PagedRow:
        """The next step's decode row (one token more than the last)."""
        self.done += 1
        return paged.PagedRow([0], [self.done - 1], self.shared, self.slots[: self.done], shared_shift=self.shifts,
                              own_blocks=self.blocks, shared_runs=self.runs)


def batch(pool, store=None) -> list[Request]:
    segs = [pool.views(pool.allocate(2), n)[0] for n in (6, 5)]
    shared = [(f"s{i}", v) for i, v in enumerate(segs)] + ([("store", store)] if store is not None else [])
    shifts = [3, 0] + ([5] if store is not None else [])
    return [Request(pool, shared, shifts, done) for done in (1, 7, 4)]


@pytest.mark.parametrize("store", [False, True])
def test_a_kept_plan_grown_step_by_step_attends_as_a_plan_built_afresh(store, monkeypatch):
    pool = make_pool(seed=1)
    g = torch.Generator().manual_seed(2)
    monkeypatch.setattr(paged.cpu_attention, "gathers", lambda buf: False)
    reqs = batch(pool, torch.randn((2, 2, 2, 4, 16), generator=g) if store else None)
    steps = SPARE_KEYS + 4  # past the spare keys: one rebuild on the way
    plans = []
    for i in range(steps):
        rows = [r.row() for r in reqs]
        with torch.inference_mode(i % 3 == 0):  # built inside inference mode (paged_forward), grown outside, ...
            plan = paged.build_plan(pool, rows, rope=ROPE)
        plans.append(plan)
        fresh = KVPool.__new__(KVPool)  # the same pool's buffer, with no plan kept
        fresh.__dict__.update(pool.__dict__, decode_plans=DecodePlans(pool.block_size))
        want = paged.build_plan(fresh, rows, rope=ROPE)
        query = torch.randn((1, 6, 3, 16), generator=g)
        got, expect = paged.attend(plan, 1, query), paged.attend(want, 1, query)
        assert torch.allclose(got, expect, atol=1e-5, rtol=0), (got - expect).abs().max()
        assert bool(plan.segments) == store  # the store tensor: merged in after the one call
    kept = pool.decode_plans
    # one plan object grown in place, replaced once when the longest row outgrew its spare keys
    assert kept.built == 2 and kept.reused == steps - 2
    assert len({id(p) for p in plans}) == 2
    # built with the longest row's keys (11 shared + 8 own) and the spare ones, rebuilt as that row
    # reached them
    assert plans[0].dense.width == 11 + 8 + SPARE_KEYS
    assert plans[-1].dense.width == 11 + 8 + SPARE_KEYS + 1 + SPARE_KEYS
    # a step repeated on the very same rows gets the kept plan as it is
    assert paged.build_plan(pool, rows, rope=ROPE) is plans[-1]


def test_a_batch_whose_membership_changed_gets_a_plan_of_its_own(monkeypatch):
    pool = make_pool(seed=3)
    monkeypatch.setattr(paged.cpu_attention, "gathers", lambda buf: False)
    reqs = batch(pool)
    first = paged.build_plan(pool, [r.row() for r in reqs], rope=ROPE)
    assert paged.build_plan(pool, [r.row() for r in reqs], rope=ROPE) is first  # the same requests, grown
    fewer = paged.build_plan(pool, [r.row() for r in reqs[:2]], rope=ROPE)  # one finished
    assert fewer is not first and fewer.dense.rows == 2
    # a request two tokens further (it skipped a step) or a prefill chunk: built afresh
    reqs[0].done += 1
    skipped = paged.build_plan(pool, [r.row() for r in reqs[:2]], rope=ROPE)
    assert skipped is not fewer
    chunk = paged.PagedRow([0, 0], [0, 1], reqs[1].shared, reqs[1].slots[: reqs[1].done + 2],
                           shared_shift=reqs[1].shifts, own_blocks=reqs[1].blocks, shared_runs=reqs[1].runs)
    mixed = paged.build_plan(pool, [reqs[0].row(), chunk], rope=ROPE)
    assert mixed is not skipped and pool.decode_plans.plan is None  # nothing kept from a mixed step
    # a row's block table changed in place: not the same layout
    rows = [r.row() for r in reqs]
    kept = paged.build_plan(pool, rows, rope=ROPE)
    reqs[2].blocks[1], reqs[2].blocks[2] = reqs[2].blocks[2], reqs[2].blocks[1]
    assert paged.build_plan(pool, [r.row() for r in reqs], rope=ROPE) is not kept


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_served_requests_grow_kept_plans_and_equal_the_oracle(family, monkeypatch):
    """The scheduler's decode steps (native kernel off) reuse the kept plan, and the greedy tokens
    are the oracle's: prompts with gaps and shared modules, decoding together for 12 tokens."""
    from oracle import definition_greedy
    from test_serving import engine, pml, serve
    from tiny import make_tokenizer
    from trip import PROMPTS

    monkeypatch.setattr(paged.cpu_attention, "gathers", lambda buf: False)
    pc = engine(family, make_tokenizer())
    schema = pc.schema("trip").layout
    reqs, sched = serve(pc, [pml(pc, p) for p in PROMPTS], max_new=12, budget=64)
    kept = sched.pool.decode_plans
    assert kept.reused >= 8 and kept.built >= 1  # most decode steps grew the kept plan
    for prompt, req in zip(PROMPTS, reqs):
        assert req.error is None
        assert req.token_ids == definition_greedy(pc.model, schema, pc.layout(prompt), 12, eos=3), prompt
