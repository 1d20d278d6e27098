"""Store documents held in the pool on the dense path (``ServingScheduler.pools_documents``).

Without the native CPU kernel (the path a GPU takes) a step's attention is one call a layer over
keys the pool holds (serving_core/dense.py). A RAG batch's documents, read in place from the
store's tensors, were each (document, shift) an attention call and a merge of their own; they are
now copied into the pool once while the batch reads them, each document whole (the runs selective
recompute leaves of it read as slots of that entry; the copy freed with its last reader), and every
layer makes the one call. The served batch (questions over the
same documents in other orders: each read at several shifts; recompute 0, a fraction, "auto") must
decode the same greedy tokens with every step's float32 logits within 1e-4 of the native path and
of the dense path that read the documents in place: rotary over every channel and over a quarter
of them, a bfloat16 pool (learned positions cannot read a document elsewhere: their modules go
through the same path in test_decode_plans.py). ALiBi keeps its own path, documents in place.
"""

from __future__ import annotations

import pytest
import torch

from promptcache import EngineConfig, PromptCache, RunnerConfig, tunables
from promptcache.engine.decoding.sampling import SamplingParams
from promptcache.engine.serving_core import paged
from promptcache.engine.serving_core.kvpool import KVPool
from promptcache.engine.serving_core.request import Request
from promptcache.engine.serving_core.scheduler import ServingScheduler
from promptcache.kernels import attention as cpu_attention
from promptcache.rag import DocumentStore
from tiny import make_model, make_tokenizer

TOL = 1e-4
NEW = 5
DOCS = {
    "paris": "Paris is the capital of France, famous for museums and cafes.",
    "tokyo": "Tokyo is a huge city in Japan with temples, food markets and fast trains.",
    "rome": "Rome is an old city with a famous tower and quiet gardens.",
}
ORDERS = [["paris", "tokyo", "rome"], ["rome", "paris", "tokyo"], ["tokyo", "rome"]]


def serve(pc, store, recompute, native: bool, pooled: bool, monkeypatch):
    """The batch served together: (requests, every step's logits, every step's plan, the most pool
    entries held at once, the entries left after it)."""
    logits, plans, entries = [], [], 0
    with monkeypatch.context() as m:
        if not native:
            m.setattr(cpu_attention, "gathers", lambda buf: False)
        m.setattr(tunables, "POOL_DOCUMENTS", pooled)
        build = paged.build_plan

        def recorded(*args, **kwargs):
            plans.append(build(*args, **kwargs))
            return plans[-1]

        m.setattr(paged, "build_plan", recorded)

        def forward(pool, rows):
            logits.append(paged.paged_forward(pc.runner, pool, rows).float())
            return logits[-1]

        pool = KVPool(pc.runner.spec, pc.device, 2048, 16)
        sched = ServingScheduler(pc.runner, pool, token_budget=24, planner=pc.core.planner, forward=forward)
        assert sched.pools_documents == (pooled and not cpu_attention.gathers(pool.buf)
                                         and pc.adapter.positional != "alibi")
        params = SamplingParams(max_new_tokens=NEW, temperature=0.0, ignore_eos=True)
        reqs = [Request(store.prompt(f"Which city is old? ({i})", ids, recompute=recompute), params, pc.tokenizer)
                for i, ids in enumerate(ORDERS)]
        for r in reqs:
            sched.add(r)
        while sched.has_work:
            sched.step()
            entries = max(entries, pool.stats()["entries"])
    assert all(r.error is None for r in reqs)
    assert pool.available_blocks == pool.num_blocks  # nothing held
    return reqs, logits, plans, entries, pool.stats()["entries"]


def batch_store(pc) -> DocumentStore:
    store = DocumentStore(pc, independent=True)
    for k, v in DOCS.items():
        store.add(k, v)
    return store


@pytest.mark.parametrize("family,kv_dtype", [("llama", None), ("llama", "bfloat16"), ("gpt_neox", None)])
@pytest.mark.parametrize("recompute", [0.0, 0.3, "auto"])
def test_documents_in_the_pool_decode_as_read_in_place(family, kv_dtype, recompute, monkeypatch):
    torch.manual_seed(0)
    pc = PromptCache(make_model(family), make_tokenizer(), EngineConfig(runner=RunnerConfig(kv_dtype=kv_dtype)))
    store = batch_store(pc)
    new, new_logits, new_plans, entries, left = serve(pc, store, recompute, native=False, pooled=True,
                                                      monkeypatch=monkeypatch)
    old, old_logits, old_plans, _, _ = serve(pc, store, recompute, native=False, pooled=False, monkeypatch=monkeypatch)
    runs = []
    if cpu_attention.available():  # the native path (a CPU with the kernel built), documents in place as runs
        runs.append(serve(pc, store, recompute, native=True, pooled=True, monkeypatch=monkeypatch)[:2])
    # the pool path: every step's keys in the one call, nothing merged from outside the pool
    assert all(p.dense is not None and not p.segments and not p.limited for p in new_plans)
    # in place, some step merged documents from the store's tensors after it (a bfloat16 pool cannot
    # read the store's float32 states in place: they were copied in, a copy a run of a document)
    assert any(p.dense is not None and (p.segments or p.limited) for p in old_plans) == (kv_dtype is None)
    # each document once (whole, whatever runs recompute left of it), and the system prefix
    assert 0 < entries <= len(DOCS) + 1
    # copies of the store's states go with their last reader (a bfloat16 pool's promoted float32 states
    # stay idle, as any promoted entry does)
    assert left == 0 or kv_dtype is not None
    for reqs, logits in [(old, old_logits)] + runs:
        assert [r.token_ids for r in new] == [r.token_ids for r in reqs]
        assert len(logits) == len(new_logits)
        for got, want in zip(new_logits, logits):
            assert got.shape == want.shape
            assert got.numel() == 0 or (got - want).abs().max().item() <= TOL, (got - want).abs().max()
    if recompute == 0.3:  # documents were cut around recomputed tokens: their runs read the whole entry
        assert sum(r.kv.plan.recomputed for r in new) > 0
        assert any(seg.part_of is not None for r in new for seg in r.kv.plan.segments)


def test_alibi_and_the_native_kernel_read_documents_in_place(monkeypatch):
    """bloom (ALiBi: its own path) under the dense switch, and llama with the native kernel: the
    documents are read from the store's tensors, the pool holds only the requests' own blocks."""
    cases = [("bloom", False)] + ([("llama", True)] if cpu_attention.available() else [])
    for family, native in cases:
        pc = PromptCache(make_model(family), make_tokenizer())
        reqs, _, _, entries, _ = serve(pc, batch_store(pc), 0.0, native=native, pooled=True, monkeypatch=monkeypatch)
        assert entries == 0 and all(r.kv.bytes_copied == 0 for r in reqs), family


def test_documents_the_pool_has_no_room_for_are_read_in_place(monkeypatch):
    """A pool with one block beside the request's own: the copies that fit are made, the others read
    in place and merged after the one call; the answer is the native path's."""
    pc = PromptCache(make_model("llama"), make_tokenizer())
    store = batch_store(pc)
    spec = store.prompt("Which city is old? (0)", ORDERS[0], recompute=0.0)
    plan = pc.core.planner.plan(spec)
    own = -(-(len(plan.new_ids) + NEW) // 16)
    runs = []
    for native in (False, True):
        logits, plans = [], []
        with monkeypatch.context() as m:
            if not native:
                m.setattr(cpu_attention, "gathers", lambda buf: False)
            build = paged.build_plan

            def recorded(*args, **kwargs):
                plans.append(build(*args, **kwargs))
                return plans[-1]

            def forward(pool, rows):
                logits.append(paged.paged_forward(pc.runner, pool, rows))
                return logits[-1]

            m.setattr(paged, "build_plan", recorded)
            pool = KVPool(pc.runner.spec, pc.device, 16 * (own + 1), 16)
            sched = ServingScheduler(pc.runner, pool, token_budget=64, planner=pc.core.planner, forward=forward)
            req = Request(spec, SamplingParams(max_new_tokens=NEW, temperature=0.0, ignore_eos=True), pc.tokenizer)
            sched.add(req)
            sched.step()
            held = pool.stats()["entries"]
            while sched.has_work:
                sched.step()
        assert req.error is None and pool.free_blocks == pool.num_blocks
        runs.append((req.token_ids, logits, plans, held))
    (tokens, logits, plans, held), (want_tokens, want, _, _) = runs
    assert held == 1 and all(p.dense is not None and p.segments for p in plans)  # one copy, the rest in place
    assert tokens == want_tokens
    for got, ref in zip(logits, want):
        assert got.numel() == 0 or (got - ref).abs().max().item() <= TOL


@pytest.mark.parametrize("recompute", [0.0, "auto"])
def test_steps_too_large_for_one_call_decode_the_same_in_groups(recompute, monkeypatch):
    """Where one padded call would exceed ``DENSE_MAX`` (decode rows beside prefill chunks), the rows
    are attended a group a call (``dense.dense_steps``): the same tokens and logits as one call, and
    no step falls back to the per-part path."""
    torch.manual_seed(0)
    pc = PromptCache(make_model("llama"), make_tokenizer(), EngineConfig())
    store = batch_store(pc)
    one, one_logits, one_plans, _, _ = serve(pc, store, recompute, native=False, pooled=True, monkeypatch=monkeypatch)
    assert all(p.dense is not None and not p.dense_parts for p in one_plans)
    kv_heads = pc.runner.spec.kv_heads
    widest = max(p.dense.rows * p.dense.queries * p.dense.width for p in one_plans)
    longest_row = max(p.dense.queries * p.dense.width for p in one_plans)
    monkeypatch.setattr(tunables, "DENSE_MAX", kv_heads * longest_row)  # every row fits alone, not every step
    assert kv_heads * longest_row < kv_heads * widest
    split, split_logits, split_plans, _, _ = serve(pc, store, recompute, native=False, pooled=True,
                                                   monkeypatch=monkeypatch)
    assert any(p.dense_parts for p in split_plans)
    assert all(p.dense is not None or p.dense_parts for p in split_plans)
    assert [r.token_ids for r in split] == [r.token_ids for r in one]
    for got, want in zip(split_logits, one_logits, strict=True):
        assert got.shape == want.shape
        assert got.numel() == 0 or (got - want).abs().max().item() <= TOL
