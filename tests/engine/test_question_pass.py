"""The question pass (``engine/prefill/question_pass.py``): the attention query-aware selections
rank the reused tokens by, from a forward that stops after the layers it reads.

Against the reference (one eager forward of every layer, hooks capturing the probabilities): the
same scores (float32, relative 1e-4) and so the same chosen slots, for every layer or a prefix of
them and for the last queries only; the cache is left as it was; the forward stops where it says.
Through the engine: ``qattn_fast`` at r=1 is a plain prefill, at r=0 the splice, in between it
recomputes what its pass ranks first. Bad passes are refused with the field named.
"""

from __future__ import annotations

import pytest
import torch

from oracle import plain_logits_at
from promptcache import EngineConfig, PromptCache, RecomputeConfig
from promptcache.engine.prefill.question_pass import QuestionPass, question_attention, question_scores
from promptcache.engine.prefill.recompute import SCORED, choose, register_selection, top
from promptcache.models import get_adapter
from promptcache.models.splice import SpliceCache
from test_recompute import SCHEMA, UNIONS  # a prompt whose reused modules drift
from tiny import FAMILIES, make_model, make_tokenizer

TOL = 1e-4
N_CACHED, N_NEW = 14, 5


def _assembled(family: str):
    """(adapter, cache holding N_CACHED tokens at gapped positions, new ids, new positions)."""
    name, _, attn = family.partition(":")
    adapter = get_adapter(make_model(name, attn=attn or None))
    vocab = adapter.model.get_input_embeddings().num_embeddings
    g = torch.Generator().manual_seed(3)
    cached = torch.randint(3, vocab, (1, N_CACHED), generator=g)
    cached_pos = torch.cat([torch.arange(0, 6), torch.arange(9, 17)])[None]  # a gap: text between spans
    cache = SpliceCache(adapter.kv_spec(), N_CACHED + N_NEW)
    adapter.forward(cached, cached_pos, cache)
    ids = torch.randint(3, vocab, (1, N_NEW), generator=g)
    pos = torch.arange(17, 17 + N_NEW)[None]
    return adapter, cache, ids, pos


def _reference(adapter, cache, ids, pos, last: int | None = None) -> torch.Tensor:
    """Per layer [L, N_CACHED]: eager probabilities of the new tokens (the last ``last`` only)."""
    if last is None:
        out = question_attention(adapter, lambda: adapter.forward(ids, pos, cache), N_CACHED)
    else:  # the reference's hooks, keeping the last queries' rows
        got = []
        hook = lambda _m, _a, o: got.append(o[1][..., -last:, :N_CACHED].float().sum(dim=(0, 1, 2)))
        mods = [m for m in adapter.model.modules() if type(m).__name__.endswith("Attention")]
        handles = [m.register_forward_hook(hook) for m in mods]
        try:
            with adapter.attention_as("eager"):
                adapter.forward(ids, pos, cache)
        finally:
            for h in handles:
                h.remove()
        out = torch.stack(got)
    cache.set_length(N_CACHED)
    return out


def _close(got: torch.Tensor, want: torch.Tensor) -> bool:
    return torch.allclose(got, want, rtol=TOL, atol=TOL * max(1.0, float(want.abs().max())))


@pytest.mark.parametrize("family", FAMILIES + ["llama:eager"])
def test_every_layer_equals_the_eager_reference_and_chooses_the_same_slots(family):
    adapter, cache, ids, pos = _assembled(family)
    before = cache.buf[:, :, :, :, :N_CACHED].clone()
    want = _reference(adapter, cache, ids, pos).sum(0)
    got = question_scores(adapter, cache, ids, pos, QuestionPass())
    assert got.shape == (N_CACHED,) and _close(got, want), (got, want)
    slots = list(range(N_CACHED))
    for k in (1, 4, 9):
        assert top(got, slots, k) == top(want, slots, k)
    assert cache.length == N_CACHED  # the pass leaves the cache as it found it
    assert torch.equal(cache.buf[:, :, :, :, :N_CACHED], before)


@pytest.mark.parametrize("family", ["llama", "gemma3_text", "gpt2", "bloom"])
def test_a_prefix_of_the_layers_is_the_references_same_layers(family):
    adapter, cache, ids, pos = _assembled(family)
    per_layer = _reference(adapter, cache, ids, pos)  # [2, N_CACHED]: the tiny models have 2 layers
    got = question_scores(adapter, cache, ids, pos, QuestionPass(stop=0.5))
    assert _close(got, per_layer[0]) and not _close(got, per_layer.sum(0))
    got = question_scores(adapter, cache, ids, pos, QuestionPass(first=0.5))
    assert _close(got, per_layer[1])


@pytest.mark.parametrize("family", ["llama", "gemma3_text", "qwen3"])
def test_the_last_queries_alone_are_the_references_last_rows(family):
    adapter, cache, ids, pos = _assembled(family)
    want = _reference(adapter, cache, ids, pos, last=2)[:1].sum(0)
    got = question_scores(adapter, cache, ids, pos, QuestionPass(stop=0.5, queries=2))
    assert _close(got, want)
    every = question_scores(adapter, cache, ids, pos, QuestionPass(stop=0.5, queries=N_NEW + 10))
    assert _close(every, _reference(adapter, cache, ids, pos)[0])  # more than there are: every query


def test_the_forward_stops_after_the_last_read_layer():
    adapter, cache, ids, pos = _assembled("llama")
    ran = []
    layers = adapter.model.model.layers
    handles = [m.register_forward_pre_hook(lambda m, a, i=i: ran.append(i)) for i, m in enumerate(layers)]
    try:
        question_scores(adapter, cache, ids, pos, QuestionPass(stop=0.5))
        first = list(ran)
        ran.clear()
        question_scores(adapter, cache, ids, pos, QuestionPass())
    finally:
        for h in handles:
            h.remove()
    assert first == [0] and ran == [0, 1]
    assert adapter.attn_implementation() == "sdpa"  # the model's own attention again


def test_a_question_pass_that_reads_nothing_is_refused_naming_the_field():
    with pytest.raises(ValueError, match="first=0.5, stop=0.5"):
        QuestionPass(first=0.5, stop=0.5)
    with pytest.raises(ValueError, match="stop=1.5"):
        QuestionPass(stop=1.5)
    with pytest.raises(ValueError, match="'queries'.*0"):
        QuestionPass(queries=0)
    with pytest.raises(ValueError, match="scores_from or question_pass"):
        register_selection("study_both", lambda s, r, k: [], scores_from=0.0, question_pass=QuestionPass())
    assert QuestionPass(stop=1 / 3).layers(30) == range(0, 10)
    assert QuestionPass(stop=1 / 8).layers(2) == range(0, 1)  # at least one layer
    assert SCORED["qattn"] == QuestionPass() and SCORED["qattn_fast"].layers(30) == range(0, 10)




def _engine(family: str, selection: str) -> PromptCache:
    pc = PromptCache(make_model(family), make_tokenizer(), EngineConfig(recompute=RecomputeConfig(selection=selection)))
    pc.add_schema(SCHEMA)
    return pc


@pytest.mark.parametrize("family", ["llama", "gemma3_text", "gpt_neox", "mpt"])
def test_qattn_fast_at_r1_is_a_plain_prefill_and_at_r0_the_splice(family):
    pc = _engine(family, "qattn_fast")
    layout = pc.layout(UNIONS)
    full = pc.prefill(UNIONS, recompute=1.0)
    assert torch.max(torch.abs(full.logits - plain_logits_at(pc.model, layout.token_ids, layout.position_ids))) <= TOL
    assert 0 < full.recomputed_tokens <= full.cached_tokens  # every drifted token (leading exact spans are not)
    splice = pc.prefill(UNIONS, recompute=0.0)
    plain_splice = _engine(family, "qmatch").prefill(UNIONS, recompute=0.0)
    assert splice.recomputed_tokens == 0 and torch.equal(splice.logits, plain_splice.logits)


@pytest.mark.parametrize("family", ["llama", "gemma3_text"])
def test_qattn_fast_recomputes_the_slots_the_references_first_layers_rank_first(family):
    """Through the engine, its budget of slots, the ones the reference's first third of the layers
    ranks first; the prompt is not called exact. (The serving path's rows equal this private
    prefill's: tests/engine/test_recompute_rows.py.)"""
    pc = _engine(family, "qattn_fast")
    plan, req = pc.core.planner.pml_parts(UNIONS, None, 0.3, None)
    n_cached = plan.cached_tokens
    ids, pos = torch.tensor([plan.new_ids]), torch.tensor([plan.new_pos])
    cache = pc.runner.pool.acquire(n_cached + len(plan.new_ids), [(seg.placed, seg.n) for seg in plan.segments])
    try:
        cache.place(plan.segments)
        ref = question_attention(pc.adapter, lambda: pc.adapter.forward(ids, pos, cache), n_cached)
        cache.set_length(n_cached)
        fast = question_scores(pc.adapter, cache, ids, pos, SCORED["qattn_fast"])
    finally:
        pc.runner.pool.release(cache)
    layers = SCORED["qattn_fast"].layers(ref.shape[0])
    want = choose(req, ref[layers.start : layers.stop].sum(0))
    assert _close(fast, ref[layers.start : layers.stop].sum(0)) and choose(req, fast) == want
    assert want != choose(req, ref.sum(0)) or want != choose(req, ref[-1])  # the layers read decide
    res = pc.prefill(UNIONS, recompute=0.3)
    assert res.recomputed_tokens == len(want) == req.budget > 0 and not res.exact
