"""The serving core: concurrent requests over one KV pool, one packed forward per step.

Exactness: a request served among others (chunked prefill, batched decode, states read in place)
gets the oracle's logits (within 1e-4) and greedy tokens for every family the pool serves, with
module gaps, unions, parameters, uncached modules, token chains and recompute rows in prompt order.
Memory: admission waits for room instead of failing, cancellation frees blocks at the next step,
a finished chat's prompt and answer blocks are reused by its next turn.
"""

from __future__ import annotations

import pytest
import torch

from oracle import definition_greedy, definition_state, plain_logits, plain_logits_at
from promptcache import PromptCache, tunables
from promptcache.engine import PmlPrompt, TokenPrompt
from promptcache.engine.serving_core.prefix import PrefixCache
from promptcache.engine.serving_core.kvpool import KVPool, PoolFull
from promptcache.engine.serving_core.paged import paged_refusal
from promptcache.engine.serving_core.request import Request
from promptcache.engine.decoding.sampling import SamplingParams
from promptcache.engine.serving_core.scheduler import ServingScheduler
from promptcache.pml import parse_prompt
from tiny import FAMILIES, FIRST_TIER, make_model, make_tokenizer
from trip import POOLED, PROMPTS, SCHEMA

TOL = 1e-4
@pytest.fixture(scope="module")
def tokenizer():
    return make_tokenizer()


def engine(family, tokenizer) -> PromptCache:
    pc = PromptCache(make_model(family), tokenizer)
    pc.add_schema(SCHEMA)
    return pc


def serve(pc, plans, max_new=8, budget=12, pool_tokens=1024, block=16, **kw) -> tuple[list[Request], ServingScheduler]:
    """Serve requests (prompt specs) together until all finish."""
    pool = KVPool(pc.runner.spec, pc.device, pool_tokens, block)
    sched = ServingScheduler(pc.runner, pool, token_budget=budget, **kw, planner=pc.core.planner)
    reqs = []
    for p in plans:
        params = SamplingParams(max_new_tokens=max_new, temperature=0.0)
        reqs.append(Request(p, params, pc.tokenizer))
        sched.add(reqs[-1])
    for _ in range(10_000):
        if not sched.has_work:
            break
        sched.step()
    assert not sched.has_work
    return reqs, sched


PREFIX_SCHEMA = """<schema name="prefix"><system>You are a travel planner.</system>
  <user><module name="intro">Plan a trip of three days.</module>
  <module name="paris">Paris is the capital of France, famous for museums.</module></user></schema>"""
PREFIX_PROMPT = '<prompt schema="prefix"><intro/><paris/> Highlight the food and keep it cheap.</prompt>'


def pml(pc, prompt, recompute=0):
    """A PML prompt at recompute=0: drifted prompts too are read in place (the oracle's definition)."""
    return PmlPrompt(parse_prompt(prompt), recompute=recompute)


def tokens(ids) -> TokenPrompt:
    """Token ids reusing and publishing chain blocks in namespace "ns" (the scheduler's chains)."""
    return TokenPrompt(tuple(ids), "ns", reuse=True)


def plain(pc, ids, max_new: int) -> list[int]:
    """Greedy tokens after a baseline prefill of ``ids`` (nothing reused)."""
    return pc.generate(list(ids), max_new_tokens=max_new, temperature=0.0, use_cache=False).token_ids


def test_the_pool_serves_every_family_and_refuses_a_model_that_fails_its_self_check(tokenizer, monkeypatch):
    assert sorted(POOLED) == sorted(FAMILIES)
    for family in FAMILIES:
        assert paged_refusal(PromptCache(make_model(family), tokenizer).runner) is None, family
    from promptcache.models import families  # an ALiBi term off by 1% is refused, naming the check
    right = families.Bloom.paged_bias
    monkeypatch.setattr(families.Bloom, "paged_bias", lambda self, positions: right(self, positions) * 1.01)
    assert "self-check" in paged_refusal(PromptCache(make_model("bloom"), tokenizer).runner)


@pytest.mark.parametrize("family", POOLED)
def test_concurrent_requests_equal_the_oracle(family, tokenizer):
    pc = engine(family, tokenizer)
    schema = pc.schema("trip").layout
    reqs, sched = serve(pc, [pml(pc, p) for p in PROMPTS], max_new=8, budget=12)  # chunks of <= 12 tokens
    for prompt, req in zip(PROMPTS, reqs):
        assert req.error is None and req.finish_reason in ("length", "stop")
        layout = pc.layout(prompt)
        ref, _, _ = definition_state(pc.model, schema, layout)
        assert torch.max(torch.abs(req.prefill.logits - ref)).item() <= TOL, prompt
        assert req.token_ids == definition_greedy(pc.model, schema, layout, 8, eos=3), prompt
        # read in place (the dense path copies them into the pool: ServingScheduler.pools_documents)
        assert req.prefill.cached_tokens > 0 and (req.prefill.bytes_copied == 0 or sched.pools_documents)
    assert sched.decode_tokens > sched.decode_forwards  # decode rows shared forwards
    assert sched.pool.free_blocks == sched.pool.num_blocks  # everything given back


def test_a_drifted_prompt_under_auto_recomputes_rows_of_the_step(tokenizer):
    """The default recompute ("auto") recomputes part of a drifted prompt: its plan runs the
    chosen tokens as rows in prompt order; an exact prompt is read in place and keeps no order."""
    pc = engine("llama", tokenizer)
    pc.add_schema(PREFIX_SCHEMA)
    assert pc.plan(PROMPTS[0]).recomputed > 0 and pc.plan(PREFIX_PROMPT).new_order is None
    params = SamplingParams(max_new_tokens=6, temperature=0.0)
    pool = KVPool(pc.runner.spec, pc.device, 1024, 16)
    sched = ServingScheduler(pc.runner, pool, planner=pc.core.planner)
    reqs = [Request(pml(pc, p, recompute=None), params, pc.tokenizer) for p in (PROMPTS[0], PREFIX_PROMPT)]
    for r in reqs:
        sched.add(r)
    while sched.has_work:
        sched.step()
    drifted, exact = reqs
    assert drifted.prefill.recomputed_tokens > 0 and not drifted.prefill.exact
    assert drifted.token_ids == pc.generate(PROMPTS[0], max_new_tokens=6, temperature=0.0).token_ids
    assert exact.prefill.exact and exact.prefill.recomputed_tokens == 0
    assert exact.prefill.bytes_copied == 0 or sched.pools_documents  # in place (the dense path: in the pool)


def test_a_recompute_prompt_is_served_beside_pooled_ones(tokenizer):
    """A recompute prompt's rows are chunked and batched with other requests' rows."""
    pc = engine("llama", tokenizer)
    start = pml(pc, PROMPTS[0], recompute=0.5)
    reqs, _ = serve(pc, [pml(pc, PROMPTS[1]), start, pml(pc, PROMPTS[2])])
    want = pc.generate(PROMPTS[0], max_new_tokens=8, temperature=0.0, recompute=0.5)
    assert reqs[1].token_ids == want.token_ids and reqs[1].prefill.recomputed_tokens > 0
    assert reqs[0].token_ids == pc.generate(PROMPTS[1], max_new_tokens=8, temperature=0.0, recompute=0).token_ids


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_token_chains_are_exact_and_a_chat_reuses_its_answer(family, tokenizer):
    pc = PromptCache(make_model(family), tokenizer)
    chains = PrefixCache(pc.store, pc.model_key, 8)
    pool = KVPool(pc.runner.spec, pc.device, 1024, 8)
    sched = ServingScheduler(pc.runner, pool, token_budget=20, planner=pc.core.planner, chains=chains)
    ids = pc.tokenizer("You are a travel planner. Plan a trip of three days to Paris, Tokyo or Rome.").input_ids

    def turn(prompt, max_new=10):
        req = Request(tokens(prompt), SamplingParams(max_new_tokens=max_new, temperature=0.0),
                      pc.tokenizer)
        sched.add(req)
        while sched.has_work:
            sched.step()
        assert req.error is None
        return req

    first = turn(ids)
    assert first.prefill.cached_tokens == 0 and first.prefill.exact
    assert torch.max(torch.abs(first.prefill.logits - plain_logits(pc.model, ids))).item() <= TOL
    second = ids + first.token_ids[:-1] + pc.tokenizer("Keep it cheap.").input_ids  # the next turn
    again = turn(second)
    ran = len(ids) + len(first.token_ids) - 1  # prompt and the answer tokens that ran through the model
    assert again.prefill.cached_tokens == ran // 8 * 8 > len(ids) - 8  # fewer than one block recomputed
    assert torch.max(torch.abs(again.prefill.logits - plain_logits(pc.model, second))).item() <= TOL
    assert again.token_ids == plain(pc, second, 10)
    assert pool.free_blocks < pool.num_blocks and pool.stats()["idle_entries"] > 0  # blocks kept for reuse


def test_evicted_chain_blocks_spill_to_the_store_and_come_back(tokenizer):
    pc = PromptCache(make_model("llama"), tokenizer)
    chains = PrefixCache(pc.store, pc.model_key, 8)
    pool = KVPool(pc.runner.spec, pc.device, 64, 8, spill=pc.store.put)  # 8 blocks
    sched = ServingScheduler(pc.runner, pool, token_budget=64, planner=pc.core.planner, chains=chains)
    ids = pc.tokenizer("Paris is the capital of France, famous for museums, cafes and the Eiffel Tower.").input_ids
    assert 24 < len(ids) < 40

    def run(prompt):
        req = Request(tokens(prompt), SamplingParams(max_new_tokens=2, temperature=0.0), pc.tokenizer)
        sched.add(req)
        while sched.has_work:
            sched.step()
        return req

    run(ids)
    pool.clear_idle()  # evict everything: the blocks go down to the store
    assert pool.stats()["entries"] == 0 and pool.evictions > 0
    again = run(ids)
    assert again.prefill.cached_tokens == (len(ids) - 1) // 8 * 8 and FIRST_TIER in again.prefill.hit_tiers
    assert torch.max(torch.abs(again.prefill.logits - plain_logits(pc.model, ids))).item() <= TOL


def test_admission_waits_for_room_and_never_overcommits(tokenizer):
    pc = engine("llama", tokenizer)
    pool_tokens = 96  # room for two of these requests' own tokens at a time
    pool = KVPool(pc.runner.spec, pc.device, pool_tokens, 16)
    sched = ServingScheduler(pc.runner, pool, token_budget=64, planner=pc.core.planner)
    reqs = [Request(pml(pc, p), SamplingParams(max_new_tokens=20, temperature=0.0), pc.tokenizer)
            for p in PROMPTS[:3]]
    for r in reqs:
        sched.add(r)
    most = 0
    while sched.has_work:
        sched.step()
        most = max(most, len(sched.running))
        assert pool.free_blocks >= 0
    assert most < 3  # the third waited for a running one to finish
    for p, r in zip(PROMPTS, reqs):
        assert r.token_ids == pc.generate(p, max_new_tokens=20, temperature=0.0, recompute=0).token_ids


def test_a_request_that_can_never_fit_fails_clearly(tokenizer):
    pc = engine("llama", tokenizer)
    reqs, _ = serve(pc, [pml(pc, PROMPTS[0])], max_new=200, pool_tokens=64)
    assert isinstance(reqs[0].error, PoolFull) and "pool" in str(reqs[0].error)


def test_cancelled_requests_free_their_blocks_at_the_next_step(tokenizer):
    pc = engine("llama", tokenizer)
    pool = KVPool(pc.runner.spec, pc.device, 1024, 16)
    sched = ServingScheduler(pc.runner, pool, token_budget=4, max_running=2, planner=pc.core.planner)  # prefills take several steps
    reqs = [Request(pml(pc, p), SamplingParams(max_new_tokens=50, temperature=0.0), pc.tokenizer)
            for p in PROMPTS[:3]]
    for r in reqs:
        sched.add(r)
    sched.step()
    decoding, prefilling, queued = reqs[0], reqs[1], reqs[2]
    while decoding.pending is None:
        sched.step()
    assert prefilling.prefill is None and queued in sched.waiting  # still prefilling; still queued
    for r in reqs:
        r.cancel()
    outs = sched.step()
    assert {o.request_id for o in outs if o.finish_reason == "cancelled"} == {r.id for r in reqs}
    assert not sched.has_work and pool.free_blocks == pool.num_blocks


def test_pool_allocates_runs_and_evicts_idle_entries_least_recently_used(tokenizer):
    spec = PromptCache(make_model("llama"), tokenizer).runner.spec
    spilled = []
    pool = KVPool(spec, "cpu", 8 * 4, 4, spill=lambda k, kv: spilled.append((k, kv.shape[3])))
    a = pool.allocate(3)
    assert a == [0, 1, 2] and pool.free_blocks == 5
    pool.buf[:, :, :, :12] = 1.0
    for i, key in enumerate("xyz"):
        assert pool.publish(key, [a[i]], 4, torch.arange(4)) is not None
    assert pool.publish("x", [a[0]], 4, torch.arange(4)) is None  # a key is published once
    e = pool.acquire("x")
    assert e.refs == 1 and pool.available_blocks == 7  # x is read: not evictable
    got = pool.allocate(7)
    assert got is not None and [k for k, _ in spilled] == ["y", "z"]  # idle entries, oldest first
    assert pool.allocate(1) is None  # nothing free, nothing evictable
    pool.release(e)
    assert pool.allocate(1) == [0] and spilled[-1] == ("x", 4)
    with pytest.raises(PoolFull, match="holds 8"):
        pool.allocate(9)


def test_requests_arriving_together_behind_one_new_prompt_compute_it_once(tokenizer):
    pc = PromptCache(make_model("llama"), tokenizer)
    chains = PrefixCache(pc.store, pc.model_key, 8)
    shared = pc.tokenizer("You are a travel planner. Plan a trip of three days to Paris, Tokyo or Rome. "
                          "Keep it cheap and highlight the food.").input_ids
    prompts = [shared + pc.tokenizer(q).input_ids for q in ("Paris?", "Tokyo, please.", "Rome now.", "Any?")]
    pool = KVPool(pc.runner.spec, pc.device, 1024, 8)
    sched = ServingScheduler(pc.runner, pool, token_budget=12, planner=pc.core.planner, chains=chains)  # the shared prompt takes several steps
    reqs = [Request(tokens(ids), SamplingParams(max_new_tokens=4, temperature=0.0), pc.tokenizer)
            for ids in prompts]
    for r in reqs:
        sched.add(r)
    while sched.has_work:
        sched.step()
    own = sum(len(p) - len(shared) for p in prompts)
    assert sched.prefill_tokens <= len(shared) + own + 4 * 8  # the shared part once (and partial blocks)
    assert all(r.prefill.cached_tokens >= len(shared) // 8 * 8 for r in reqs[1:])
    for ids, r in zip(prompts, reqs):
        assert torch.max(torch.abs(r.prefill.logits - plain_logits(pc.model, ids))).item() <= TOL


def test_the_fallback_attention_ops_equal_the_fused_kernel(tokenizer, monkeypatch):
    """Where torch has no fused CPU attention returning the log-sum-exp, plain ops do the same."""
    import promptcache.engine.serving_core.paged as paged

    monkeypatch.setattr(paged, "_CPU_FLASH", None)
    pc = engine("qwen2", tokenizer)
    schema = pc.schema("trip").layout
    reqs, _ = serve(pc, [pml(pc, p) for p in PROMPTS[:2]], max_new=4)
    for prompt, req in zip(PROMPTS, reqs):
        ref, _, _ = definition_state(pc.model, schema, pc.layout(prompt))
        assert torch.max(torch.abs(req.prefill.logits - ref)).item() <= TOL


@pytest.mark.parametrize("family", POOLED)
def test_prefix_identity_through_the_pool(family, tokenizer):
    """Identity 1 of the design: a prefix prompt served among others equals a plain forward."""
    pc = engine(family, tokenizer)
    pc.add_schema(PREFIX_SCHEMA)
    reqs, _ = serve(pc, [pml(pc, PROMPTS[0]), pml(pc, PREFIX_PROMPT), pml(pc, PREFIX_PROMPT)], max_new=3)
    ids = pc.layout(PREFIX_PROMPT).token_ids
    for r in reqs[1:]:
        assert r.prefill.exact and r.prefill.cached_tokens > 10
        assert torch.max(torch.abs(r.prefill.logits - plain_logits(pc.model, ids))).item() <= TOL


@pytest.mark.parametrize("family", ["llama", "gpt_neox"])
def test_recompute_identity_through_the_pool(family, tokenizer):
    """Identity 4: recompute=1.0 (every cached token a row of the step) equals a plain forward
    over the prompt's tokens at the layout's positions, and decodes on in the pool."""
    pc = engine(family, tokenizer)
    prompt = PROMPTS[1]
    start = pml(pc, prompt, recompute=1.0)
    reqs, _ = serve(pc, [pml(pc, PROMPTS[0]), start], max_new=6)
    layout = pc.layout(prompt)
    ref = plain_logits_at(pc.model, layout.token_ids, layout.position_ids)
    assert torch.max(torch.abs(reqs[1].prefill.logits - ref)).item() <= TOL
    assert reqs[1].token_ids == pc.generate(prompt, max_new_tokens=6, temperature=0.0, recompute=1.0).token_ids


@pytest.mark.parametrize("native_gather", [True, False])
def test_a_decode_row_with_a_long_own_part_is_read_in_place_and_stays_exact(tokenizer, monkeypatch, native_gather):
    """Rows whose own part is longer than GATHER_MAX: through the native gather op (it reads each row's
    own slots in place up to its length), or without it outside the padded gather; exact either way."""
    import promptcache.engine.serving_core.paged as paged

    monkeypatch.setattr(paged, "GATHER_MAX", 8)  # the tiny prompts' own parts are longer than this
    if not native_gather:
        monkeypatch.setattr(paged.cpu_attention, "gathers", lambda buf: False)
    pc = PromptCache(make_model("llama"), tokenizer)
    chains = PrefixCache(pc.store, pc.model_key, 8)
    long_ids = pc.tokenizer("Paris is the capital of France, famous for museums, cafes and the Eiffel Tower.").input_ids
    short_ids = long_ids[:5]
    pool = KVPool(pc.runner.spec, pc.device, 1024, 8)
    sched = ServingScheduler(pc.runner, pool, token_budget=64, planner=pc.core.planner, chains=chains)
    reqs = [Request(tokens(ids), SamplingParams(max_new_tokens=6, temperature=0.0), pc.tokenizer)
            for ids in (long_ids, short_ids)]
    for r in reqs:
        sched.add(r)
    while sched.has_work:
        sched.step()
    for ids, r in zip((long_ids, short_ids), reqs):
        assert r.token_ids == plain(pc, ids, 6)


def test_decode_rows_of_any_own_length_share_one_gather_where_the_native_op_reads_the_pool(tokenizer, monkeypatch):
    """The plan: with the native gather op every decode row is a gathered decode row (one call a
    layer, no padding cost); without it a row past GATHER_MAX is read as a prefill-like part."""
    import promptcache.engine.serving_core.paged as paged

    monkeypatch.setattr(paged, "GATHER_MAX", 8)
    pc = PromptCache(make_model("llama"), tokenizer)
    pool = KVPool(pc.runner.spec, pc.device, 256, 8)
    slots = [pool.slots(pool.allocate(n // 8 + 1), 0, n) for n in (20, 5, 40)]
    rows = [paged.PagedRow([1], [len(s) - 1], [], s, logits=True) for s in slots]
    for native in (True, False):
        monkeypatch.setattr(paged.cpu_attention, "gathers", lambda buf, native=native: native)
        plan = paged.build_plan(pool, rows)
        if native:
            assert plan.decode_q.tolist() == [0, 1, 2] and not plan.prefills and plan.decodes_only
            assert plan.decode_lengths.tolist() == [20, 5, 40]
        else:  # one padded call a layer over every row's keys (dense.py) ...
            assert plan.decode_q is None and not plan.prefills and (plan.dense.rows, plan.dense.width) == (3, 40)
            monkeypatch.setattr(tunables, "DENSE_MAX", 0)  # ... or, past its size, part by part
            plan = paged.build_plan(pool, rows)
            monkeypatch.undo()
            monkeypatch.setattr(paged, "GATHER_MAX", 8)
            assert plan.dense is None
            assert plan.decode_q.tolist() == [1] and [p[:2] for p in plan.prefills] == [(0, 1), (2, 3)]


def test_a_decode_row_reads_its_shared_pool_runs_and_store_tensors_in_its_gather(tokenizer, monkeypatch):
    """FOLD_SHARED: a decode row's shared segments held in the pool join its own slots in the native
    gather, and so does a store tensor read in place (a run of a source of its own: no cascade
    segment left for the row); a store tensor the op cannot read (another dtype) stays a segment; a
    chunk reads the pool run with its own tokens in the prefill op's runs (FOLD_PREFILL,
    test_prefill_runs.py); FOLD_SHARED off leaves the decode row's segments to cascade attention."""
    import promptcache.engine.serving_core.paged as paged

    monkeypatch.setattr(paged.cpu_attention, "gathers", lambda buf: True)
    pc = PromptCache(make_model("llama"), tokenizer)
    pool = KVPool(pc.runner.spec, pc.device, 256, 8)
    shared_blocks = pool.allocate(2)
    run = pool.slots(shared_blocks, 0, 16)
    view = pool.views(shared_blocks, 16)[0]
    stored = torch.zeros_like(view)  # a store tensor, read in place
    other = torch.zeros_like(view, dtype=torch.float16)  # one the gather op does not read
    own = [pool.slots(pool.allocate(1), 0, n) for n in (3, 5)]
    rows = [paged.PagedRow([1], [40], [("pool:x", view), ("doc", stored), ("half", other)], own[0],
                           shared_slots=[run, None, None]),
            paged.PagedRow([1, 2, 3, 4, 5], [16, 17, 18, 19, 20], [("pool:x", view)], own[1], shared_slots=[run])]
    plan = paged.build_plan(pool, rows)
    assert plan.decode_q.tolist() == [0] and plan.decode_lengths.tolist() == [16 + 16 + 3]
    assert plan.decode_slots[0, :35].tolist() == run.tolist() + list(range(16)) + own[0].tolist()
    runs = plan.decode_runs  # the pool run, the store tensor (source 0), the row's own slots
    assert runs.starts.tolist() == [[0, 16, 32]] and runs.src.tolist() == [[-1, 0, -1]]
    assert len(runs.sources) == 1 and runs.sources[0].data_ptr() == stored.data_ptr()
    assert sorted(idx.tolist() for _, idx in plan.segments) == [[0]]  # float16
    chunk = plan.prefill_runs  # the chunk: the pool run, then its own slots
    assert not plan.prefills and chunk.runs.starts.tolist() == [[0, 16]] and chunk.lengths.tolist() == [21]
    assert chunk.slots[0].tolist() == run.tolist() + own[1].tolist() and chunk.queries == slice(1, 6)
    assert chunk.limits.tolist() == [[16, n] for n in range(1, 6)]
    monkeypatch.setattr(paged, "FOLD_SHARED", False)
    plan = paged.build_plan(pool, rows)
    assert plan.decode_lengths.tolist() == [3] and plan.decode_runs is None
    assert sorted(idx.tolist() for _, idx in plan.segments) == [[0], [0], [0]]
    monkeypatch.setattr(paged, "FOLD_PREFILL", False)
    plan = paged.build_plan(pool, rows)
    assert plan.prefill_runs is None
    assert sorted(idx.tolist() for _, idx in plan.segments) == [[0], [0], [0, 1, 2, 3, 4, 5]]


def test_a_fragmented_pool_allocates_the_longest_free_runs_first(tokenizer):
    spec = PromptCache(make_model("llama"), tokenizer).runner.spec
    pool = KVPool(spec, "cpu", 10 * 4, 4)
    taken = pool.allocate(10)
    pool.free([taken[i] for i in (0, 1, 3, 5, 6, 7, 9)])  # free runs: 0-1, 3, 5-7, 9
    assert pool.allocate(2) == [0, 1]  # the first run long enough
    pool.free([0, 1])
    assert pool.allocate(4) == [5, 6, 7, 0]  # no run of 4: 5-7 then the next longest
    assert pool.allocate(3) == [1, 3, 9]


def test_a_pool_full_of_idle_entries_evicts_the_oldest_until_one_run_holds_a_request(tokenizer):
    """After a pool filled, free blocks lie between idle entries: a request gets one run by evicting
    idle entries, least recently used first, never a running request's blocks or a pinned entry."""
    spec = PromptCache(make_model("llama"), tokenizer).runner.spec
    pinned = {"p"}
    spilled = []
    pool = KVPool(spec, "cpu", 12 * 4, 4, spill=lambda k, kv: spilled.append(k), pinned=lambda k: k in pinned)
    taken = pool.allocate(12)
    # blocks: 0 running, 1 entry a, 2 free, 3 entry b, 4 free, 5 free, 6 entry p (pinned), 7 free,
    # 8 entry c, 9 free, 10 entry d, 11 free; a is the least recently used, d the most
    for key, block in (("a", 1), ("b", 3), ("p", 6), ("c", 8), ("d", 10)):
        pool.publish(key, [block], 4, torch.arange(4))
    pool.free([taken[i] for i in (2, 4, 5, 7, 9, 11)])
    assert pool.allocate(3) == [1, 2, 3] and spilled == ["a", "b"]  # a alone opened a run of 2: b too
    assert pool.allocate(4) == [7, 8, 9, 10] and spilled == ["a", "b", "c", "d"]  # p is pinned: c, d
    assert pool.allocate(2) == [4, 5] and len(spilled) == 4  # a free run: nothing evicted
    pool.free([1, 2, 3, 4, 5, 7, 8, 9, 10])
    got = pool.allocate(10)  # the pinned entry splits the pool: 10 blocks come in two pieces
    assert sorted(got) == [1, 2, 3, 4, 5, 7, 8, 9, 10, 11] and "p" not in spilled


def test_a_prompt_stored_in_scattered_blocks_is_read_together_and_stays_exact(tokenizer, monkeypatch):
    """A shared prompt whose blocks lie apart in the pool is more segments than SEGMENTS_MAX: they
    are attended as one (concatenated a layer at a time), with the same answer as a plain prefill."""
    import promptcache.engine.serving_core.paged as paged

    monkeypatch.setattr(tunables, "DENSE_MAX", 0)  # the per-part path (dense.py reads every pool run by slot)
    monkeypatch.setattr(paged, "FOLD_PREFILL", False)  # segments, not runs of the native prefill op
    grouped = []
    group = paged._group_segments
    monkeypatch.setattr(paged, "_group_segments",
                        lambda segs, dev: grouped.append((len(segs), len(out := group(segs, dev)))) or out)
    pc = PromptCache(make_model("llama"), tokenizer)
    chains = PrefixCache(pc.store, pc.model_key, 4)
    pool = KVPool(pc.runner.spec, pc.device, 64 * 4, 4)
    singles = [pool.allocate(1)[0] for _ in range(64)]
    pool.free(singles[::2])  # no two free blocks adjoin: a request's blocks are all apart
    sched = ServingScheduler(pc.runner, pool, token_budget=64, planner=pc.core.planner, chains=chains)
    ids = pc.tokenizer("Paris is the capital of France, famous for museums, cafes and the Eiffel Tower.").input_ids
    outs = []
    for prompt in (ids, ids + ids[:3]):
        req = Request(tokens(prompt), SamplingParams(max_new_tokens=4, temperature=0.0), pc.tokenizer)
        sched.add(req)
        while sched.has_work:
            sched.step()
        assert req.token_ids == plain(pc, prompt, 4)
        outs.append(req)
    assert outs[1].prefill.cached_tokens >= 4 * (paged.SEGMENTS_MAX + 1)
    assert any(n > paged.SEGMENTS_MAX and g == 1 for n, g in grouped)  # read together


def test_chain_keys_hash_each_block_once_and_start_over_on_other_tokens():
    from promptcache.engine.serving_core.chains import ChainKeys, chained

    def want(ids):
        return chained("root", [(ids[i * 4 : (i + 1) * 4], 8 + i * 4) for i in range(len(ids) // 4)])

    keys, ids = ChainKeys(4, "root", 8), list(range(30))
    for n in (3, 4, 9, 17, 30):  # a request's own tokens growing
        assert keys(ids[:n]) == want(ids[:n])
    other = [7] + ids[1:12]
    assert keys(other) == want(other)  # not an extension: keyed afresh


@pytest.mark.parametrize("segments", [0, 1, 2, 5])
@pytest.mark.parametrize("kernel", ["fused", "own-by-matmul", "no-fused-kernel", "dense"])
def test_a_decode_only_step_attends_as_plain_attention_over_the_concatenated_keys(segments, kernel, monkeypatch, device):
    """The decode-only attention (interpolated merges, no step-wide scatter; the rows' own tokens
    through the fused kernel or matrix products) equals softmax attention over each row's
    segments followed by its own tokens, and the general path; so does one padded call over the
    keys gathered by slot (``dense``: the path without the native kernel)."""
    import promptcache.models.splice as cache
    import promptcache.engine.serving_core.paged as paged

    monkeypatch.setattr(tunables, "DENSE_MAX", 1 << 22 if kernel == "dense" else 0)

    if kernel == "own-by-matmul":
        monkeypatch.setattr(paged, "DECODE_MATMUL_ROWS", 1)
    if kernel == "no-fused-kernel":
        monkeypatch.setattr(paged, "_CPU_FLASH", None)
    g = torch.Generator().manual_seed(segments)
    spec = cache.KVSpec(layers=2, kv_heads=2, head_dim=8, dtype=torch.float32)
    pool = KVPool(spec, device, tokens=512, block_size=4)
    pool.buf.copy_(torch.randn(pool.buf.shape, generator=g))
    views = [pool.views(pool.allocate(2), 5 + i)[0] for i in range(segments)]  # 5, 6, ... tokens each
    shared = [(f"s{i}", v) for i, v in enumerate(views)]
    owns = [pool.slots(pool.allocate(2), 0, n) for n in (1, 3, 7)]  # own tokens so far, this one included
    rows = [paged.PagedRow([0], [0], shared, own) for own in owns]
    plan = paged.build_plan(pool, rows)
    assert plan.decodes_only or (kernel == "dense" and plan.dense is not None and not plan.segments)
    query = torch.randn((1, 6, len(rows), 8), generator=g).to(device)  # 6 query heads over 2 kv heads
    got = paged.attend(plan, 1, query)  # [1, B, Hq, D]
    plan.decodes_only = False
    general = paged.attend(plan, 1, query)
    for b, own in enumerate(owns):
        k = torch.cat([v[1, 0] for v in views] + [pool.buf[1, 0][:, own]], dim=1)  # [Hk, n, D]
        v = torch.cat([v[1, 1] for v in views] + [pool.buf[1, 1][:, own]], dim=1)
        q = query[0, :, b].view(2, 3, 8)  # query head h reads kv head h // 3
        want = torch.softmax(q @ k.transpose(1, 2) / 8 ** 0.5, dim=-1) @ v  # [Hk, G, D]
        assert torch.allclose(got[0, b], want.reshape(6, 8), atol=1e-5, rtol=0)
        assert torch.allclose(general[0, b], want.reshape(6, 8), atol=1e-5, rtol=0)


def test_a_step_with_a_chunk_or_a_segment_some_rows_skip_takes_the_general_path(monkeypatch, device):
    import promptcache.models.splice as cache
    import promptcache.engine.serving_core.paged as paged

    monkeypatch.setattr(tunables, "DENSE_MAX", 0)  # the per-part path (without it, no native kernel: dense.py)

    spec = cache.KVSpec(layers=1, kv_heads=1, head_dim=4, dtype=torch.float32)
    pool = KVPool(spec, device, tokens=64, block_size=4)
    seg = [("s", pool.views(pool.allocate(1), 4)[0])]
    a, b = pool.slots(pool.allocate(1), 0, 2), pool.slots(pool.allocate(1), 0, 2)
    assert not paged.build_plan(pool, [paged.PagedRow([0], [0], seg, a), paged.PagedRow([0], [0], [], b)]).decodes_only
    assert not paged.build_plan(pool, [paged.PagedRow([0, 0], [0, 1], seg, a)]).decodes_only


@pytest.mark.parametrize("runs", [1, 3, 6])
@pytest.mark.parametrize("head_dim", [8, 16])
def test_a_chunk_whose_earlier_tokens_lie_in_pieces_attends_as_plain_causal_attention(runs, head_dim, monkeypatch, device):
    """A prefill chunk whose row's earlier own tokens lie in several pool runs (a reused prefix's
    blocks, then blocks of its own) reads each run in place, or all of them gathered past
    SEGMENTS_MAX runs; either way it equals causal softmax attention over the row's tokens in order."""
    import promptcache.models.splice as cache
    import promptcache.engine.serving_core.paged as paged

    monkeypatch.setattr(tunables, "DENSE_MAX", 0)  # the per-part path (dense.py: test_dense_attention.py)

    g = torch.Generator().manual_seed(runs * head_dim)
    spec = cache.KVSpec(layers=2, kv_heads=2, head_dim=head_dim, dtype=torch.float32)
    pool = KVPool(spec, device, tokens=512, block_size=4)
    pool.buf.copy_(torch.randn(pool.buf.shape, generator=g))
    pieces = []
    for _ in range(runs + 1):  # a block between pieces, so each piece is a run of its own
        pieces.append(pool.allocate(2))
        pool.allocate(1)
    earlier = torch.cat([pool.slots(b, 0, 7) for b in pieces[:runs]])  # 7 tokens of each piece
    new = pool.slots(pieces[runs], 0, 5)
    own = torch.cat([earlier, new])
    plan = paged.build_plan(pool, [paged.PagedRow([0] * 5, list(range(5)), [], own)])
    (_, _, new_part, parts), = plan.prefills  # no document: the causal path, not the prefill op's runs
    assert isinstance(new_part, slice) and plan.prefill_runs is None
    assert len(parts) == (runs if runs <= paged.SEGMENTS_MAX else 1)
    assert all(isinstance(p, slice) for p in parts) == (runs <= paged.SEGMENTS_MAX)
    query = torch.randn((1, 6, 5, head_dim), generator=g).to(device)  # 6 query heads over 2 kv heads
    got = paged.attend(plan, 1, query)  # [1, 5, Hq, D]
    k, v = pool.buf[1, 0][:, own], pool.buf[1, 1][:, own]  # [Hk, n, D]
    n = own.numel()
    for i in range(5):  # new token i sees the earlier tokens and new tokens 0..i
        q = query[0, :, i].view(2, 3, head_dim)
        seen = n - 5 + i + 1
        want = torch.softmax(q @ k[:, :seen].transpose(1, 2) / head_dim ** 0.5, dim=-1) @ v[:, :seen]
        assert torch.allclose(got[0, i], want.reshape(6, head_dim), atol=1e-5, rtol=0)
