"""Selective recompute as rows of the serving step, against the private path it replaced.

The private path (``PromptCache.prefill`` / ``DocumentStore.prefill`` with ``keep_cache``: the
prompt assembled in its own buffer, the chosen tokens written over their slots in one forward
masked by prompt order, then greedy decoding in that buffer) is the reference. The serving path
runs the same chosen tokens as prefill rows over the pool, chunked (a small token budget) and
batched with other requests. For every selection kind (question-blind, question-attention,
key-scaling) and fractions 0 .. 1.0, on rotary, ALiBi and windowed families: the same greedy
tokens and float32 logits within 1e-4, the same counts of recomputed tokens and the same
``exact``.
"""

from __future__ import annotations

import pytest
import torch

from promptcache import PromptCache
from promptcache.engine import PmlPrompt
from promptcache.engine.decoding.sampling import SamplingParams
from promptcache.engine.prefill.config import EngineConfig, RecomputeConfig
from promptcache.engine.serving_core.kvpool import KVPool
from promptcache.engine.serving_core.request import Request
from promptcache.engine.serving_core.scheduler import ServingScheduler
from promptcache.kernels import attention as cpu_attention
from promptcache.pml import parse_prompt
from promptcache.rag import DocumentStore
from tiny import make_model, make_tokenizer
from trip import PROMPTS, SCHEMA

TOL = 1e-4
NEW = 6
SELECTIONS = ["qmatch", "tail", "qattn", "qattn_fast", "ape"]  # by token ids, by position, by attention, scaling keys
FRACTIONS = [0.0, 0.3, 1.0, "auto"]
DOCS = {
    "paris": "Paris is the capital of France, famous for museums and cafes.",
    "tokyo": "Tokyo is a huge city in Japan with temples, food markets and fast trains.",
    "rome": "Rome is an old city with a famous tower and quiet gardens.",
}
QUESTIONS = [("Where are temples?", ["paris", "tokyo"], None), ("Which city is old?", ["rome", "paris", "tokyo"], "Be brief.")]


@pytest.fixture(scope="module")
def tokenizer():
    return make_tokenizer()


def private_greedy(pc: PromptCache, res, n: int) -> list[int]:
    """Greedy tokens decoded in the private buffer ``res.cache`` (kept with room for ``n``)."""
    out, logits, pos = [], res.logits, res.next_position
    for _ in range(n):
        token = int(logits.argmax())
        out.append(token)
        if token in pc.runner.eos_ids:
            break
        ids = torch.tensor([[token]], device=pc.device)
        logits = pc.runner.forward(ids, torch.tensor([[pos]], device=pc.device), res.cache)[0]
        pos += 1
    pc.release(res)
    return out


def serve(pc: PromptCache, specs, budget: int = 5) -> list[Request]:
    """``specs`` served together: chunks of at most ``budget`` tokens, batched with each other's rows."""
    sched = ServingScheduler(pc.runner, KVPool(pc.runner.spec, pc.device, 2048, 16), token_budget=budget, planner=pc.core.planner)
    reqs = [Request(s, SamplingParams(max_new_tokens=NEW, temperature=0.0), pc.tokenizer) for s in specs]
    for r in reqs:
        sched.add(r)
    while sched.has_work:
        sched.step()
    for r in reqs:
        if r.error is not None:
            raise r.error
    assert sched.pool.free_blocks == sched.pool.num_blocks
    return reqs


def check(got: Request, want, want_tokens: list[int], what) -> None:
    assert torch.max(torch.abs(got.prefill.logits.float() - want.logits.float())).item() <= TOL, what
    assert got.token_ids == want_tokens, what
    assert got.prefill.recomputed_tokens == want.recomputed_tokens, what
    assert got.prefill.cached_tokens == want.cached_tokens and got.prefill.exact == want.exact, what


@pytest.mark.parametrize("family", ["llama", "bloom", "mistral", "gpt_neox"])
@pytest.mark.parametrize("selection", SELECTIONS)
def test_pml_recompute_rows_equal_the_private_prefill(family, selection, tokenizer):
    pc = PromptCache(make_model(family), tokenizer, EngineConfig(recompute=RecomputeConfig(selection=selection)))
    pc.add_schema(SCHEMA)
    cases = [(p, r) for r in FRACTIONS for p in PROMPTS]
    reqs = serve(pc, [PmlPrompt(parse_prompt(p), recompute=r) for p, r in cases])
    recomputed = 0
    for (p, r), got in zip(cases, reqs):
        want = pc.prefill(p, reserve=NEW + 1, keep_cache=True, recompute=r)
        check(got, want, private_greedy(pc, want, NEW), (family, selection, r, p))
        recomputed += got.prefill.recomputed_tokens
    assert recomputed > 0  # the fractions above 0 chose something


@pytest.mark.parametrize("family", ["llama", "bloom"])
@pytest.mark.parametrize("mode", ["independent", "prefixed"])
def test_document_recompute_rows_equal_the_private_prefill(family, mode, tokenizer):
    pc = PromptCache(make_model(family), tokenizer, EngineConfig(recompute=RecomputeConfig(selection="anchored")))
    store = DocumentStore(pc, independent=True, prefixed=mode == "prefixed")
    for k, v in DOCS.items():
        store.add(k, v)
    cases = [(q, r) for r in (0.0, 0.15, 1.0, "auto") for q in QUESTIONS]
    reqs = serve(pc, [store.prompt(q, ids, system, recompute=r) for (q, ids, system), r in cases], budget=7)
    for ((q, ids, system), r), got in zip(cases, reqs):
        want = store.prefill(q, ids, system, reserve=NEW + 1, keep_cache=True, recompute=r)
        check(got, want, private_greedy(pc, want, NEW), (family, mode, r, q))
    assert reqs[-1].prefill.recomputed_tokens > 0


def test_key_limits_without_the_native_kernel_equal_it(tokenizer, monkeypatch):
    """The masked fallback of per-query key limits computes what the native ``attend_limits`` does."""
    pc = PromptCache(make_model("llama"), tokenizer, EngineConfig(recompute=RecomputeConfig(selection="qattn")))
    pc.add_schema(SCHEMA)
    specs = [PmlPrompt(parse_prompt(p), recompute=0.5) for p in PROMPTS]
    native = serve(pc, specs)
    monkeypatch.setattr(cpu_attention, "limits_kernel_for", lambda q, kv: None)
    masked = serve(pc, specs)
    for a, b in zip(native, masked):
        assert torch.max(torch.abs(a.prefill.logits - b.prefill.logits)).item() <= TOL
        assert a.token_ids == b.token_ids


def test_recomputed_tokens_are_rows_in_prompt_order_and_their_stored_copies_are_not_read(tokenizer):
    pc = PromptCache(make_model("llama"), tokenizer, EngineConfig(recompute=RecomputeConfig(selection="tail")))
    pc.add_schema(SCHEMA)
    plain, plan = pc.plan(PROMPTS[1], recompute=0), pc.plan(PROMPTS[1], recompute=0.5)
    assert plain.new_order is None and plan.new_order == sorted(plan.new_order)
    assert plan.recomputed > 0 and len(plan.new_ids) == len(plain.new_ids) + plan.recomputed
    assert plan.cached_tokens == plain.cached_tokens - plan.recomputed  # the stale copies left the segments
    assert all(seg.order is not None for seg in plan.segments)


@pytest.mark.parametrize("family", ["llama", "bloom"])
def test_documents_are_read_in_place_at_any_position(family, tokenizer):
    """Questions over the same documents in other orders read each document's stored tensor itself
    (no moved copy, no pool copy): the batch holds the distinct documents once, plus each
    question's own rows (new and recomputed tokens) in its own blocks. Without the native kernel (a
    GPU) each document is copied into the pool once instead, whole, for every question."""
    pc = PromptCache(make_model(family), tokenizer)
    store = DocumentStore(pc, independent=True)
    for k, v in DOCS.items():
        store.add(k, v)
    orders = [["paris", "tokyo", "rome"], ["rome", "paris", "tokyo"], ["tokyo", "rome", "paris"]]
    sched = ServingScheduler(pc.runner, KVPool(pc.runner.spec, pc.device, 2048, 16), token_budget=512, planner=pc.core.planner)
    reqs = [Request(store.prompt("Which city is old?", ids, recompute=r), SamplingParams(max_new_tokens=NEW, temperature=0.0),
                    tokenizer) for ids in orders for r in (0.0, "auto")]
    for r in reqs:
        sched.add(r)
    sched.step()  # every request admitted (one step holds all their prompts): its shared views are known
    assert not sched.waiting
    stored = {pc.store.get(store.state_key(store.unit_ids(store.get(d))))[0].untyped_storage().data_ptr()
              for d in DOCS}
    read = {view.untyped_storage().data_ptr() for r in reqs for _, view in r.kv.shared}
    assert sum(r.kv.shared_shift is not None and any(r.kv.shared_shift) for r in reqs) == len(reqs)  # read elsewhere
    own = sum(len(r.kv.blocks) for r in reqs)
    if sched.pools_documents:  # without the native kernel (a GPU): each document copied into the pool once
        assert read == {sched.pool.buf.untyped_storage().data_ptr()}
        assert sched.pool.stats()["entries"] == len(DOCS) + 1  # and the prompts' prefix
    else:
        assert stored <= read and len(read - stored) == 1  # the documents themselves, and the prompts' prefix
        assert sched.pool.num_blocks - sched.pool.free_blocks == own  # nothing else entered the pool
    while sched.has_work:
        sched.step()
    for (ids, r), got in zip([(ids, r) for ids in orders for r in (0.0, "auto")], reqs):
        want = store.prefill("Which city is old?", ids, reserve=NEW + 1, keep_cache=True, recompute=r)
        check(got, want, private_greedy(pc, want, NEW), (family, ids, r))
