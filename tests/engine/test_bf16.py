"""bfloat16 where the CPU has it (models/native_dtype.py, packed bf16 linears, the native kernel
over a bfloat16 pool, ``dtype="auto"``).

The oracle in bfloat16 (docs/DESIGN.md section 4): two bfloat16 computations that round in a
different order cannot be held to an identity, so the paged bfloat16 engine is held to the
float32 run of the same weights: within 1.5x a plain bfloat16 forward's distance to it plus 0.05,
both within 0.4 (logits of magnitude ~5: a wrong position, mask or block is off by whole units).
``PROMPTCACHE_BF16=0`` stands for a CPU without bfloat16 instructions: float32 is kept there.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from oracle import definition_state, plain_logits
from promptcache import EngineConfig, PromptCache, RunnerConfig
from promptcache.models.loading import load_model
from promptcache.models.native_dtype import ENV_SWITCH, auto_dtype, bf16_native, bf16_refusal, checkpoint_dtype
from tiny import fresh_model, make_model, make_tokenizer, packed_refused
from trip import POOLED, PROMPTS, SCHEMA, serve_together

NATIVE = bf16_native("cpu")
needs_bf16 = pytest.mark.skipif(not NATIVE, reason=f"this CPU computes no bfloat16 natively: {bf16_refusal('cpu')}")
needs_cpu = pytest.mark.cpu_only(refusal=packed_refused)  # packed linears: off the CPU, their refusal

PREFIX_SCHEMA = """<schema name="prefix"><system>You are a travel planner.</system>
  <user><module name="intro">Plan a trip of three days.</module>
  <module name="paris">Paris is the capital of France, famous for museums.</module></user></schema>"""
PREFIX_PROMPT = '<prompt schema="prefix"><intro/><paris/> Highlight the food and keep it cheap.</prompt>'


@pytest.fixture(scope="module")
def tokenizer():
    return make_tokenizer()


def within_the_bf16_rule(got: torch.Tensor, plain16: torch.Tensor, ref32: torch.Tensor) -> tuple[bool, float, float]:
    err_plain = (plain16.float() - ref32.float()).abs().max().item()
    err_got = (got.float() - ref32.float()).abs().max().item()
    return err_plain <= 0.4 and err_got <= 0.4 and err_got <= 1.5 * err_plain + 0.05, err_got, err_plain


def bf16_engine(family, tokenizer, **runner) -> PromptCache:
    pc = PromptCache(fresh_model(family).to(torch.bfloat16), tokenizer, EngineConfig(runner=RunnerConfig(**runner)))
    pc.add_schema(SCHEMA)
    pc.add_schema(PREFIX_SCHEMA)
    return pc


@pytest.mark.parametrize("family", POOLED)
def test_the_paged_bf16_engine_keeps_the_oracle_for_every_family(family, tokenizer):
    """Identity 1 (a prefix prompt vs a plain forward) and identity 2 (each prompt vs its
    definition), served together through the bfloat16 pool, against the same computations in
    bfloat16 and in float32 of the same weights."""
    pc, ref = bf16_engine(family, tokenizer), make_model(family)
    assert pc.runner.spec.dtype == torch.bfloat16  # the pool holds the model's dtype: bfloat16
    prompts = PROMPTS + [PREFIX_PROMPT]
    reqs = serve_together(pc, prompts)
    for prompt, req in zip(prompts, reqs):
        assert req.error is None, (prompt, req.error)
        if prompt == PREFIX_PROMPT:
            ids = pc.layout(prompt).token_ids
            assert req.prefill.exact
            plain16, ref32 = plain_logits(pc.model, ids), plain_logits(ref, ids)
        else:
            schema = pc.schema("trip").layout
            plain16 = definition_state(pc.model, schema, pc.layout(prompt))[0]
            ref32 = definition_state(ref, schema, pc.layout(prompt))[0]
        ok, err_got, err_plain = within_the_bf16_rule(req.prefill.logits, plain16, ref32)
        assert ok, (family, prompt, err_got, err_plain)


@needs_cpu
@needs_bf16
@pytest.mark.parametrize("family", ["llama", "qwen2", "gpt_neox"])
def test_packed_bf16_linears_keep_the_oracle_and_run_in_bfloat16(family, tokenizer):
    """oneDNN's bfloat16 kernels (q/k/v and gate/up one product each) inside the paged engine."""
    from promptcache.models.packed import PackedLinear

    pc, ref = bf16_engine(family, tokenizer, packed_linear=True), make_model(family)
    packed = [m.__dict__["forward"] for m in pc.model.modules() if isinstance(m.__dict__.get("forward"), PackedLinear)]
    assert packed and all(p.weight.dtype == torch.bfloat16 for p in packed)
    stock = fresh_model(family).to(torch.bfloat16)
    reqs = serve_together(pc, [PREFIX_PROMPT, PROMPTS[1]])
    ids = pc.layout(PREFIX_PROMPT).token_ids
    ok, err_got, err_plain = within_the_bf16_rule(reqs[0].prefill.logits, plain_logits(stock, ids), plain_logits(ref, ids))
    assert ok, (err_got, err_plain)
    assert reqs[1].error is None and len(reqs[1].token_ids) > 0


def test_auto_is_the_checkpoints_bf16_where_the_cpu_has_it_and_float32_where_forced_off(tmp_path, monkeypatch, tokenizer):
    model = fresh_model("llama").to(torch.bfloat16)
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    assert checkpoint_dtype(model.config) == torch.bfloat16
    got, _ = load_model(tmp_path, dtype="auto")
    assert next(got.parameters()).dtype == (torch.bfloat16 if NATIVE else torch.float32)
    monkeypatch.setenv(ENV_SWITCH, "0")  # a CPU without bfloat16 instructions
    assert bf16_refusal("cpu") == f"turned off by {ENV_SWITCH}" and not bf16_native("cpu")
    got, _ = load_model(tmp_path, dtype="auto")
    assert next(got.parameters()).dtype == torch.float32
    pc = PromptCache.from_pretrained(tmp_path)  # from_pretrained's default is auto
    assert pc.runner.spec.dtype == torch.float32
    got, _ = load_model(tmp_path, dtype="bfloat16")  # asked for by name: loaded as asked
    assert next(got.parameters()).dtype == torch.bfloat16


def test_auto_keeps_a_float32_checkpoint_in_float32_on_a_cpu_and_says_why():
    f32 = make_model("llama").config
    assert auto_dtype(f32, "cpu") == (torch.float32, "the checkpoint's float32")
    assert auto_dtype(f32, "cuda")[0] == torch.bfloat16
    picked, why = auto_dtype(SimpleNamespace(dtype="float16"), "cpu")  # a config.json's spelling
    assert picked == torch.float32 and "float16" in why
    assert auto_dtype(SimpleNamespace(torch_dtype="bfloat16"), "cuda")[0] == torch.bfloat16  # an older config's key


def test_the_cli_says_the_dtype_it_loaded_and_whether_the_cpu_computes_bfloat16():
    from promptcache.frontend.common import dtype_line

    line = dtype_line("auto", torch.float32, "cpu")
    assert line.startswith("float32 (auto; cpu computes ")
    assert ("bfloat16 natively" in line) == NATIVE
