"""Engine API: errors, loading, shapes, ALiBi bias, streaming, sampling, threads, devices."""

from __future__ import annotations

import concurrent.futures as cf
import time

import pytest
import torch

from oracle import definition_state
from promptcache import EngineConfig, PMLError, PromptCache, RecomputeConfig, RunnerConfig, layout_schema
from promptcache.models.splice import SpliceCache
from promptcache.models import UnsupportedModelError, get_adapter, supported_model_types
from tiny import DEVICE, FAMILIES, fresh_model, make_model, make_tokenizer

SCHEMA = """<schema name="s">
  <system>You are a travel planner.</system>
  <user>
    <module name="plan">Plan a trip of <parameter name="days" length="3"/> days.</module>
    <union scaffold="paris">
      <module name="paris">Paris is the capital of France.</module>
      <module name="tokyo">Tokyo is a huge city in Japan.</module>
    </union>
  </user>
</schema>"""
PROMPT = '<prompt schema="s"><plan days="3"/><tokyo/> Highlight the food.</prompt>'


@pytest.fixture(scope="module")
def pc():
    engine = PromptCache(make_model("llama"), make_tokenizer(), EngineConfig(recompute=RecomputeConfig(fraction=0)))  # compared to the definition
    engine.add_schema(SCHEMA)
    return engine


def test_unknown_schema_is_a_clear_error(pc):
    with pytest.raises(PMLError, match=r"unknown schema 'nope' \(added in namespace 'default': s\)"):
        pc.prefill('<prompt schema="nope"><a/></prompt>')


def test_argument_too_long_names_both_counts(pc):
    with pytest.raises(PMLError, match=r"argument 'days' of module 'plan' is \d+ tokens, the parameter allows 3"):
        pc.prefill('<prompt schema="s"><plan days="three or four or five days"/></prompt>')


def test_unsupported_architecture_lists_supported():
    from transformers import T5Config, T5ForConditionalGeneration

    model = T5ForConditionalGeneration(T5Config(vocab_size=64, d_model=16, d_ff=32, num_layers=1, num_heads=2, d_kv=8))
    with pytest.raises(UnsupportedModelError) as e:
        PromptCache(model, make_tokenizer())
    for name in ("llama", "bloom", "gpt2", "opt", "falcon", "mpt", "gpt_neox", "qwen3", "phi3"):
        assert name in str(e.value)
    assert set(supported_model_types()) >= {"llama", "mistral", "qwen2", "qwen3", "phi3", "gpt_neox", "falcon",
                                             "bloom", "mpt", "gpt2", "opt"}


def test_failed_add_schema_leaves_engine_unchanged(pc):
    before, entry = pc.prefill(PROMPT).logits, pc.schema("s")
    with pytest.raises(PMLError, match="length"):
        pc.add_schema(SCHEMA.replace('length="3"', 'length="x"'))  # same name, fails while parsing
    with pytest.raises(PMLError):
        pc.add_schema("<schema name='s'><module name='a'>unclosed</schema>")

    def fail(done, total):
        raise RuntimeError("interrupted")

    edited = SCHEMA.replace("huge city", "big city")  # same name, new text: fails while encoding
    with pytest.raises(RuntimeError, match="interrupted"):
        pc.add_schema(edited, progress=fail)
    assert pc.schemas == ["s"] and pc.schema("s") is entry
    new_keys = set(pc.registry.content_keys(layout_schema(edited, pc.tok), "default").values()) - set(entry.keys.values())
    assert new_keys and not any(k in pc.store for k in new_keys)  # nothing of the failed schema was stored
    assert torch.equal(pc.prefill(PROMPT).logits, before)


def test_kv_spec_matches_the_model_cache_for_every_family():
    tok = make_tokenizer()
    for family in FAMILIES:
        model = make_model(family)
        adapter = get_adapter(model)
        spec = adapter.kv_spec()
        with torch.inference_mode():
            out = model(input_ids=torch.tensor([[5, 6, 7]], device=model.device), use_cache=True)
        layer = out.past_key_values.layers[0]
        assert tuple(layer.keys.shape) == (1, spec.kv_heads, 3, spec.head_dim), family
        assert len(out.past_key_values.layers) == spec.layers
        entry = PromptCache(model, tok).add_schema(SCHEMA)
        assert entry.stored_bytes == entry.stored_tokens * spec.bytes_per_token


def test_grouped_and_multi_query_shapes():
    assert get_adapter(make_model("llama")).kv_spec().kv_heads == 2  # GQA: 4 query heads, 2 kv heads
    assert get_adapter(make_model("qwen3")).kv_spec().head_dim == 16  # explicit head_dim


@pytest.mark.parametrize("family", ["bloom", "mpt", "falcon_alibi"])
def test_alibi_bias_equals_stock_bias_at_gapped_positions(family):
    """The hook's bias for keys at positions P equals the model's own bias for a contiguous run,
    read at the columns P (up to the per-row constant MPT subtracts)."""
    model = make_model(family)
    adapter, device = get_adapter(model), model.device
    captured = {}

    def grab(module, args, kwargs):
        captured.setdefault("kw", dict(kwargs))

    block = adapter.blocks()[0]
    handle = block.register_forward_pre_hook(grab, with_kwargs=True)
    try:
        with torch.inference_mode():
            model(input_ids=torch.tensor([list(range(5, 15))], device=device),
                  attention_mask=torch.ones(1, 10, dtype=torch.long, device=device))
    finally:
        handle.remove()
    stock = captured["kw"]
    cols = torch.tensor([0, 1, 2, 5, 6, 9], device=device)
    if family == "falcon_alibi":  # the merged mask is [B, H, q, kv]: keep the chosen key columns
        stock_cols = {**stock, "attention_mask": stock["attention_mask"][:, :, :, cols]}
    else:
        stock_cols = stock
    ours = adapter.bias_kwargs(cols[None, :], stock_cols)
    if family == "mpt":
        ref = stock["position_bias"][:, :, -10:][:, :, cols]
        got = ours["position_bias"]
        assert torch.allclose(got - got[:, :, -1:], ref - ref[:, :, -1:], atol=1e-6)
    else:
        assert torch.allclose(ours["alibi"], stock["alibi"][..., cols], atol=1e-6)
    if family == "falcon_alibi":
        ref_mask = stock["attention_mask"][:, :, -1:, cols]  # the last query sees every key
        assert torch.allclose(ours["attention_mask"][:, :, -1:, :], ref_mask, atol=1e-6)


def test_alibi_hook_changes_results_only_with_gaps():
    model = make_model("bloom")
    adapter, device = get_adapter(model), model.device

    def run(pos):
        cache = SpliceCache(adapter.kv_spec(), 16, device=device)
        ids = torch.tensor([[5, 6, 7, 8]], device=device)
        return adapter.forward(ids, torch.tensor([pos], device=device), cache)[0]

    assert torch.allclose(run([0, 1, 2, 3]), run([40, 41, 42, 43]), atol=1e-5)  # ALiBi is translation-free
    assert not torch.allclose(run([0, 1, 2, 3]), run([0, 1, 9, 10]), atol=1e-3)  # gaps reach attention


def test_stream_yields_the_generated_text(pc):
    out = pc.generate(PROMPT, max_new_tokens=12)
    pieces = list(pc.stream(PROMPT, max_new_tokens=12))
    assert "".join(pieces) == out.text
    assert len(out.token_ids) == 12 or out.token_ids[-1] == 3


def test_stop_strings_cut_the_text(pc):
    out = pc.generate(PROMPT, max_new_tokens=16)
    assert len(out.text) > 3
    stop = out.text[2:4]
    cut = pc.generate(PROMPT, max_new_tokens=16, stop=[stop])
    assert stop not in cut.text and out.text.startswith(cut.text)


def test_sampling_is_seeded_and_top_k_one_is_greedy(pc):
    a = pc.generate(PROMPT, max_new_tokens=8, temperature=1.0, seed=1)
    b = pc.generate(PROMPT, max_new_tokens=8, temperature=1.0, seed=1)
    greedy = pc.generate(PROMPT, max_new_tokens=8)
    assert a.token_ids == b.token_ids
    assert pc.generate(PROMPT, max_new_tokens=8, temperature=0.7, top_k=1, seed=3).token_ids == greedy.token_ids
    assert pc.generate(PROMPT, max_new_tokens=8, temperature=0.7, top_p=1e-6, seed=4).token_ids == greedy.token_ids
    with pytest.raises(ValueError):
        pc.generate(PROMPT, temperature=-1)


def test_generation_statistics(pc):
    out = pc.generate(PROMPT, max_new_tokens=4)
    layout = pc.layout(PROMPT)
    assert out.cached_tokens == sum(len(s) for s in layout if s.kind == "cached")
    assert out.new_tokens == sum(len(s) for s in layout if s.kind == "new")
    assert out.usage.prompt_tokens == len(layout.token_ids) and out.usage.completion_tokens == len(out.token_ids)
    t0 = time.perf_counter()
    timed = pc.generate(PROMPT, max_new_tokens=4)
    assert 0 < timed.ttft <= time.perf_counter() - t0  # seconds, measured inside the call
    base = pc.generate(PROMPT, max_new_tokens=4, use_cache=False)
    assert base.cached_tokens == 0 and base.new_tokens == len(layout.token_ids)


def test_second_prompt_sharing_modules_copies_nothing(pc):
    # the splice (this engine's r=0): with "auto" this drifted prompt recomputes some cached slots
    # in place, and those spans are copied again by the next prompt (checked last)
    first = pc.prefill(PROMPT)
    again = pc.prefill(PROMPT.replace("Highlight the food.", "Keep it cheap."))
    other = pc.prefill('<prompt schema="s"><plan days="2"/><paris/> Go.</prompt>')
    assert again.bytes_copied == 0
    assert other.bytes_copied > 0
    assert torch.allclose(pc.prefill(PROMPT).logits, first.logits, atol=1e-6)
    auto = pc.prefill(PROMPT, recompute="auto")
    assert auto.recomputed_tokens > 0
    assert torch.allclose(pc.prefill(PROMPT, recompute="auto").logits, auto.logits, atol=1e-6)
    assert pc.prefill(PROMPT).bytes_copied > 0  # the spans whose slots were recomputed are placed again


def test_concurrent_generate_is_exact(pc):
    prompts = [PROMPT, '<prompt schema="s"><plan days="2"/><paris/> Go.</prompt>',
               '<prompt schema="s"><tokyo/> Food?</prompt>', '<prompt schema="s"><plan days=""/></prompt>']
    expected = {p: pc.generate(p, max_new_tokens=6).token_ids for p in prompts}
    schema = pc.schema("s").layout
    for p in prompts:
        ref, _, _ = definition_state(pc.model, schema, pc.layout(p))
        assert torch.max(torch.abs(pc.prefill(p).logits - ref)).item() <= 1e-4
    with cf.ThreadPoolExecutor(4) as ex:
        results = list(ex.map(lambda p: (p, pc.generate(p, max_new_tokens=6).token_ids), prompts * 4))
    for p, ids in results:
        assert ids == expected[p]


def test_from_pretrained_loads_a_local_directory(tmp_path):
    model, tok = make_model("qwen2"), make_tokenizer()
    model.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    pc = PromptCache.from_pretrained(tmp_path, device=DEVICE, dtype="float32")  # on ``ref``'s device
    pc.add_schema(SCHEMA)
    from transformers import AutoTokenizer

    ref = PromptCache(model, AutoTokenizer.from_pretrained(tmp_path))  # transformers picks the class by model type
    ref.add_schema(SCHEMA)
    assert type(pc.model) is type(model) and pc.layout(PROMPT).token_ids == ref.layout(PROMPT).token_ids
    assert torch.allclose(pc.prefill(PROMPT).logits, ref.prefill(PROMPT).logits, atol=1e-5)


def test_from_pretrained_offline_failure_says_so(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", True)  # read at import: set it too
    with pytest.raises(OSError, match="local directory"):
        PromptCache.from_pretrained("no-such-org/no-such-model")


def test_plain_prompt_without_schema(pc):
    res = pc.prefill("Plan a trip to Paris.")
    layout = pc.layout("Plan a trip to Paris.")
    assert res.cached_tokens == 0 and layout.token_ids[0] == 2  # BOS once, at position 0
    assert layout.position_ids == list(range(len(layout.token_ids)))
    with torch.inference_mode():
        ref = pc.model(input_ids=torch.tensor([layout.token_ids], device=pc.device)).logits[0, -1]
    assert torch.max(torch.abs(res.logits - ref)).item() <= 1e-4


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_matches_cpu():
    cpu = PromptCache(fresh_model("llama", seed=0).cpu(), make_tokenizer())  # on the CPU whatever tiny.DEVICE is
    cpu.add_schema(SCHEMA)
    gpu = PromptCache(fresh_model("llama", seed=0).to("cuda"), make_tokenizer())  # not the shared cached model
    gpu.add_schema(SCHEMA)
    assert torch.allclose(gpu.prefill(PROMPT).logits.cpu(), cpu.prefill(PROMPT).logits, atol=1e-4)
    assert gpu.generate(PROMPT, max_new_tokens=8).token_ids == cpu.generate(PROMPT, max_new_tokens=8).token_ids


def test_encoding_reports_progress_and_skips_stored_modules():
    calls = []
    pc = PromptCache(make_model("llama"), make_tokenizer())
    pc.add_schema(SCHEMA, progress=lambda done, total: calls.append((done, total)))
    assert calls and calls[-1][0] == calls[-1][1] > 0
    assert all(a[0] <= b[0] for a, b in zip(calls, calls[1:]))
    calls.clear()
    pc.add_schema(SCHEMA)  # every module already stored: nothing is encoded again
    pc.add_schema(SCHEMA, progress=lambda done, total: calls.append((done, total)))
    assert calls == []


def test_bos_exactly_once_when_only_the_chat_template_adds_it():
    tok = make_tokenizer(chat=True, bos=False)  # encode adds no BOS; the template starts with {{ bos_token }}
    pc = PromptCache(make_model("llama"), tok)
    pc.add_schema(SCHEMA)
    ids = pc.layout(PROMPT).token_ids
    assert ids[0] == tok.bos_token_id and ids.count(tok.bos_token_id) == 1


def test_public_names_and_results_built_by_keyword():
    import promptcache
    from promptcache.engine import EngineConfig, Generation, PrefillResult, SamplingParams

    assert promptcache.EngineConfig is EngineConfig and promptcache.SamplingParams is SamplingParams
    with pytest.raises(TypeError):
        PrefillResult(torch.zeros(4), 0.1, 3, 2, False)  # keyword only: no positional soup
    res = PrefillResult(logits=torch.zeros(4), ttft=0.1, cached_tokens=3, new_tokens=2, exact=False)
    gen = Generation.from_prefill(res, "hi", [5, 6], "stop")
    assert (gen.usage.prompt_tokens, gen.usage.completion_tokens, gen.usage.cached_tokens, gen.usage.total_tokens) == (
        5, 2, 3, 7)
    with pytest.raises(ValueError, match="finish_reason must be one of"):
        Generation.from_prefill(res, "hi", [5], "done")
    with pytest.raises(ValueError, match="RunnerConfig.encode_chunk must be an integer >= 1, got 0"):
        RunnerConfig(encode_chunk=0)
