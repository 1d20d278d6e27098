"""DocumentStore chains (``exact=True``): each document's states computed after the documents before
it in the request (RAGCache's knowledge tree). Answers equal a plain forward of the same tokens;
a later request reuses its matching leading documents; ``canonical_order`` shares more; and
independent documents with ``recompute=1.0`` equal a plain forward too."""

from __future__ import annotations

import pytest
import torch

from oracle import plain_logits_at
from promptcache import PromptCache
from promptcache.rag import DocumentStore
from tiny import make_model, make_tokenizer

TOL = 1e-4
DOCS = {
    "paris": "Paris is the capital of France, famous for museums and cafes.",
    "tokyo": "Tokyo is a huge city in Japan with temples, food markets and fast trains.",
    "rome": "Rome is an old city with a famous tower and quiet gardens.",
    "oslo": "Oslo sits at the end of a fjord; winters are long and dark.",
}
Q, SYS = "What is famous there?", "Answer briefly."


def make_store(family="llama", **kw):
    kw.setdefault("exact", not kw.get("independent"))
    store = DocumentStore(PromptCache(make_model(family), make_tokenizer()), **kw)
    for k, v in DOCS.items():
        store.add(k, v)
    return store


def plain(store, doc_ids, system=SYS):
    layout = store.layout(Q, doc_ids, system)
    return plain_logits_at(store.pc.model, layout.token_ids, layout.position_ids)


@pytest.mark.parametrize("family", ["llama", "gpt2", "bloom", "qwen2"])
def test_chain_answers_equal_a_plain_forward_and_are_reused(family):
    store = make_store(family)
    first = store.prefill(Q, ["tokyo", "paris"], SYS)
    assert first.exact and torch.max(torch.abs(first.logits - plain(store, ["tokyo", "paris"]))).item() <= TOL
    n_prefix = len(store.layout(Q, [], SYS).spans[0])
    assert first.cached_tokens == n_prefix  # nothing of the documents was stored yet
    again = store.prefill(Q, ["tokyo", "paris", "rome"], SYS)  # leading two reused, rome computed and added
    assert again.exact and torch.max(torch.abs(again.logits - plain(store, ["tokyo", "paris", "rome"]))).item() <= TOL
    two = sum(len(s) for s in store.layout(Q, ["tokyo", "paris"], SYS).spans[:3])
    assert again.cached_tokens == two
    third = store.prefill(Q, ["tokyo", "paris", "rome"], SYS)
    assert third.new_tokens == len(store.layout(Q, [], SYS).spans[-1])  # only the question ran
    assert torch.max(torch.abs(third.logits - again.logits)).item() <= TOL
    other = store.prefill(Q, ["paris", "tokyo"], SYS)  # another order: another chain, still exact
    assert other.cached_tokens == n_prefix
    assert torch.max(torch.abs(other.logits - plain(store, ["paris", "tokyo"]))).item() <= TOL


def test_chain_generation_follows_the_plain_forward():
    store = make_store()
    layout = store.layout(Q, ["rome", "oslo"], None)
    got = store.generate(Q, ["rome", "oslo"], None, max_new_tokens=4).token_ids
    store.generate(Q, ["rome", "oslo"], None, max_new_tokens=4)  # the cached chain decodes the same
    ids, pos, want = list(layout.token_ids), list(layout.position_ids), []
    for _ in range(4):
        nxt = int(torch.argmax(plain_logits_at(store.pc.model, ids, pos)))
        want.append(nxt)
        ids, pos = ids + [nxt], pos + [pos[-1] + 1]
    assert got == want
    assert store.generate(Q, ["rome", "oslo"], None, max_new_tokens=4).token_ids == want


def test_canonical_order_shares_a_chain_across_orders():
    store = make_store(canonical_order=True)
    store.prefill(Q, ["tokyo", "paris"], SYS)
    res = store.prefill(Q, ["paris", "tokyo"], SYS)
    assert [s.name for s in store.layout(Q, ["tokyo", "paris"], SYS).spans][1:3] == ["doc:paris", "doc:tokyo"]
    assert res.new_tokens == len(store.layout(Q, [], SYS).spans[-1]) and res.exact
    assert torch.max(torch.abs(res.logits - plain(store, ["paris", "tokyo"]))).item() <= TOL


@pytest.mark.parametrize("family", ["llama", "bloom", "gpt_neox"])
def test_independent_documents_with_full_recompute_equal_a_plain_forward(family):
    store = make_store(family, independent=True)
    ids = ["oslo", "tokyo", "paris"]
    naive = store.prefill(Q, ids, SYS)
    full = store.prefill(Q, ids, SYS, recompute=1.0)
    ref = plain(store, ids)
    assert torch.max(torch.abs(naive.logits - ref)).item() > TOL and not naive.exact
    assert torch.max(torch.abs(full.logits - ref)).item() <= TOL and full.exact
    assert full.recomputed_tokens == sum(len(store.get(d).token_ids) for d in ids)
    half = store.prefill(Q, ids, SYS, recompute=0.5)
    assert half.recomputed_tokens == round(0.5 * full.recomputed_tokens) and not half.exact
    text = store.generate(Q, ids, SYS, max_new_tokens=3, recompute=1.0).token_ids
    assert text[0] == int(torch.argmax(ref))


def test_bad_recompute_is_refused_before_any_work():
    store = make_store(independent=True)
    with pytest.raises(ValueError, match="recompute must be 'auto' or a fraction"):
        store.generate(Q, ["paris"], recompute=2.0)


@pytest.mark.parametrize("independent", [False, True], ids=["chains", "independent"])
def test_documents_are_stored_in_kv_dtype(tmp_path, independent):
    from promptcache.engine import EngineConfig, RunnerConfig

    def engine(kv_dtype):
        return PromptCache(make_model("llama"), make_tokenizer(), EngineConfig(runner=RunnerConfig(kv_dtype=kv_dtype)))

    ref = DocumentStore(engine(None), path=tmp_path / "ref", exact=not independent,
                        independent=independent)  # the same states kept
    half = DocumentStore(engine("bfloat16"), path=tmp_path / "docs", exact=not independent, independent=independent)
    for k, v in DOCS.items():
        ref.add(k, v)
        half.add(k, v)
    for _ in range(2):  # the second time chains reuse what the first stored
        got, want = half.prefill(Q, ["tokyo", "paris"], SYS), ref.prefill(Q, ["tokyo", "paris"], SYS)
        diff = torch.max(torch.abs(got.logits - want.logits)).item()
        assert 0 < diff < 0.05 * want.logits.abs().max().item()  # rounded states, not exact; close (as for schemas)
    held = lambda store: sum(store.pc.store.usage().values())  # noqa: E731
    assert held(half) > 0 and 2 * held(half) == held(ref)  # every state in bfloat16: half the bytes
    reopened = DocumentStore(engine("bfloat16"), path=tmp_path / "docs", exact=not independent,
                             independent=independent)
    if independent:  # the persisted bfloat16 states are read back as they were stored
        assert torch.equal(reopened.prefill(Q, ["tokyo", "paris"], SYS).logits,
                           half.prefill(Q, ["tokyo", "paris"], SYS).logits)
    else:  # chains live in memory only: a reopened store computes the documents again (only the prefix is reused)
        res = reopened.prefill(Q, ["tokyo", "paris"], SYS)
        assert res.cached_tokens == len(reopened.layout(Q, [], SYS).spans[0])
        assert torch.max(torch.abs(res.logits - want.logits)).item() < 0.05 * want.logits.abs().max().item()


@pytest.mark.parametrize("family", ["llama", "bloom"])
def test_hybrid_reuses_the_stored_chain_then_independent_documents(family):
    pc = PromptCache(make_model(family), make_tokenizer())
    chains, hybrid = DocumentStore(pc, exact=True), DocumentStore(pc)  # the default mode is the hybrid
    assert hybrid.mode == "reuse" and hybrid.hybrid and DocumentStore(pc, hybrid=True).mode == "reuse"
    for k, v in DOCS.items():
        chains.add(k, v)
        hybrid.add(k, v)
    ids = ["oslo", "tokyo", "paris"]
    ref = plain(hybrid, ids)
    fresh = hybrid.prefill(Q, ids, SYS, recompute=0)  # no chain stored yet: every document independent
    alone = DocumentStore(pc, independent=True)
    for k, v in DOCS.items():
        alone.add(k, v)
    assert torch.equal(fresh.logits, alone.prefill(Q, ids, SYS, recompute=0).logits) and not fresh.exact
    chains.prefill("an earlier question", ids[:2], SYS)  # stores the chain oslo -> tokyo
    part = hybrid.prefill(Q, ids, SYS, recompute=0)
    assert [s.name for s in part.layout.spans if s.kind == "new"] == ["(separator)", "(question)"]
    assert sum(part.hit_tiers.values()) == 4 and not part.exact  # prefix, 2 chain links, paris alone
    auto = hybrid.prefill(Q, ids, SYS)  # the default: only paris drifted, a budget of it recomputed
    assert 0 < auto.recomputed_tokens < len(hybrid.get("paris").token_ids)
    full = hybrid.prefill(Q, ids, SYS, recompute=1.0)
    assert full.recomputed_tokens == len(hybrid.get("paris").token_ids) and full.exact
    assert torch.max(torch.abs(full.logits - ref)).item() <= TOL
    chains.prefill("another", ids, SYS)  # the whole chain: nothing drifts, nothing to recompute
    whole = hybrid.prefill(Q, ids, SYS)
    assert whole.exact and whole.recomputed_tokens == 0 and torch.max(torch.abs(whole.logits - ref)).item() <= TOL


def test_modes_exclude_each_other():
    pc = PromptCache(make_model("llama"), make_tokenizer())
    for kw in ({"independent": True, "hybrid": True}, {"exact": True, "independent": True}):
        with pytest.raises(ValueError, match="exclude each other"):
            DocumentStore(pc, **kw)


def test_chains_survive_a_restart_on_the_engines_spill_folder(tmp_path):
    from promptcache import EngineConfig, StoreConfig

    model, cfg = make_model("llama"), EngineConfig(store=StoreConfig(spill_dir=str(tmp_path / "spill")))
    store = DocumentStore(PromptCache(model, make_tokenizer(), cfg), exact=True)
    for k, v in DOCS.items():
        store.add(k, v)
    first = store.prefill(Q, ["tokyo", "paris"], SYS)
    store.pc.store.persist()  # what `promptcache serve` does when it stops (by default written behind before)
    assert list((tmp_path / "spill").glob("*.safetensors"))
    store.pc.store.close()
    restarted = DocumentStore(PromptCache(model, make_tokenizer(), cfg), exact=True)  # a new process on the same folder
    for k, v in DOCS.items():
        restarted.add(k, v)
    again = restarted.prefill(Q, ["tokyo", "paris"], SYS)
    assert again.hit_tiers.get("disk", 0) == 3  # the prefix and both chain links, read back from disk
    assert again.cached_tokens == sum(len(s) for s in store.layout(Q, ["tokyo", "paris"], SYS).spans[:3])
    assert torch.max(torch.abs(again.logits - first.logits)).item() <= TOL
    restarted.pc.store.close()


def test_ape_scales_only_the_reused_documents_keys_and_leaves_the_pool_clean():
    """APE-style temperature (``selection="ape"``): recomputing every document leaves nothing to
    scale (a plain forward's answer); at r = 0.3 the answer moves away from ``qmatch``'s at 0.3;
    at r = 0 it is the splice; the buffer it scaled is not reused as the stored states by the next
    request."""
    from promptcache.engine.prefill.recompute import KEY_SCALES, qmatch, register_selection

    store = make_store(independent=True, selection="qmatch")
    ape = DocumentStore(store.pc, namespace=store.namespace, independent=True, selection="ape")
    ids = ["oslo", "tokyo", "paris"]
    for d in ids:
        ape.add(d, DOCS[d])
    assert KEY_SCALES["ape"] != 1.0
    ref = plain(store, ids)
    full = ape.prefill(Q, ids, SYS, recompute=1.0)
    assert full.exact and torch.max(torch.abs(full.logits - ref)).item() <= TOL
    splice = store.prefill(Q, ids, SYS, recompute=0)
    assert torch.max(torch.abs(ape.prefill(Q, ids, SYS, recompute=0).logits - splice.logits)).item() <= TOL
    before = store.prefill(Q, ids, SYS, recompute=0.3)
    scaled = ape.prefill(Q, ids, SYS, recompute=0.3)
    assert scaled.recomputed_tokens == before.recomputed_tokens > 0 and not scaled.exact
    assert torch.max(torch.abs(scaled.logits - before.logits)).item() > TOL  # the temperature moved it
    after = store.prefill(Q, ids, SYS, recompute=0.3)  # the pool's buffer held scaled keys: re-placed
    assert torch.max(torch.abs(after.logits - before.logits)).item() <= TOL
    register_selection("ape_unit_scale", qmatch, key_scale=1.0)
    unit = DocumentStore(store.pc, namespace=store.namespace, independent=True, selection="ape_unit_scale")
    for d in ids:
        unit.add(d, DOCS[d])
    got = unit.prefill(Q, ids, SYS, recompute=0.3)
    assert torch.max(torch.abs(got.logits - before.logits)).item() <= TOL
    with pytest.raises(ValueError, match="key_scale"):
        register_selection("ape_bad", qmatch, key_scale=0.0)


def test_documents_follow_the_engines_selection_unless_given_one():
    from promptcache import EngineConfig, RecomputeConfig

    assert make_store().selection == "qmatch" and make_store(selection="ape").selection == "ape"
    pc = PromptCache(make_model("llama"), make_tokenizer(), config=EngineConfig(recompute=RecomputeConfig(selection="tail")))
    assert DocumentStore(pc).selection == "tail"


def test_key_scale_multiplies_exactly_the_unrecomputed_keys_and_spares_the_named_documents():
    """In the request's buffer, every reused document token that was not recomputed holds the
    stored (moved) key times the scale, except the documents the question names when the
    selection spares them; recomputed tokens are computed afresh."""
    from promptcache.engine.prefill.recompute import named_spans, qmatch, recompute_request, register_selection

    register_selection("spare_named_test", qmatch, key_scale=0.5, spare_named=True)
    register_selection("scale_all_test", qmatch, key_scale=0.5)
    base = make_store(independent=True, selection="qmatch")
    ids = ["oslo", "rome", "tokyo", "paris"]
    q = "Which fjord?"  # "j" is in oslo's text only: the question names that document
    layout = base.layout(q, ids, SYS)
    n_prefix = len(layout.spans[0])
    req = recompute_request(layout, n_prefix, 0.2, "qmatch", False)
    chosen, named = set(qmatch(None, req, req.budget)), named_spans(req)
    assert named and len(named) < len(req.spans)  # the question names some documents, not all
    in_named = {s for i in named for s in range(*req.spans[i])}

    def keys(selection):
        store = DocumentStore(base.pc, namespace=base.namespace, independent=True, selection=selection)
        for d in ids:
            store.add(d, DOCS[d])
        res = store.prefill(q, ids, SYS, recompute=0.2, keep_cache=True)
        out = res.cache.buf[:, 0, 0, :, : len(req.slot_order)].clone()  # [L, H, n_cached, D]
        return out

    plain_keys, spared, scaled = keys("qmatch"), keys("spare_named_test"), keys("scale_all_test")
    for s in req.candidates:
        if s in chosen:
            continue
        want = plain_keys[:, :, s] * (1.0 if s in in_named else 0.5)
        assert torch.allclose(spared[:, :, s], want, atol=1e-6), s
        assert torch.allclose(scaled[:, :, s], plain_keys[:, :, s] * 0.5, atol=1e-6), s
    assert any(s not in chosen for s in in_named)  # a named token was spared, not only recomputed
