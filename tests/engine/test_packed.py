"""Packed linears (``EngineConfig.runner.packed_linear``): the engine's results stay exact against the
same (packed) model, and the packed model stays within float32 rounding of the stock one."""

from __future__ import annotations

import pytest
import torch

from oracle import plain_logits
from promptcache import EngineConfig, PromptCache, RecomputeConfig, RunnerConfig
from promptcache.errors import ConfigError
from promptcache.models.packed import PackedLinear, pack_linears
from tiny import FAMILIES, fresh_model, make_tokenizer, packed_refused

# every test here packs a model's linears, a CPU path: off the CPU each checks the refusal instead
pytestmark = pytest.mark.cpu_only(refusal=packed_refused)

TOL = 1e-4
SCHEMA = """<schema name="trip"><system>You are a travel planner.</system>
  <user><module name="plan">Plan a trip of three days.</module>
  <module name="paris">Paris is the capital of France, famous for museums.</module>
  <module name="cheap">Keep it cheap.</module></user></schema>"""
PROMPT = '<prompt schema="trip"><plan/><paris/> Highlight the food.</prompt>'


@pytest.fixture(scope="module")
def tokenizer():
    return make_tokenizer()


@pytest.mark.parametrize("family", FAMILIES)
def test_packed_linears_stay_within_rounding_and_the_engine_stays_exact(family, tokenizer):
    stock = fresh_model(family)
    packed = fresh_model(family)
    pc = PromptCache(packed, tokenizer, EngineConfig(runner=RunnerConfig(packed_linear=True), recompute=RecomputeConfig(fraction=0)))
    assert any(isinstance(m.__dict__.get("forward"), PackedLinear) for m in packed.modules())
    ids = tokenizer("Paris is the capital of France, famous for museums, cafes and the Eiffel Tower.").input_ids
    with torch.inference_mode():
        a = stock(torch.tensor([ids])).logits[0].float()
        b = packed(torch.tensor([ids])).logits[0].float()
    assert (a - b).abs().max().item() <= TOL * max(1.0, a.abs().max().item())
    pc.add_schema(SCHEMA)
    res = pc.prefill(PROMPT)
    assert res.exact and res.cached_tokens > 10
    want = plain_logits(packed, pc.layout(PROMPT).token_ids)  # the oracle on the same (packed) model
    assert torch.max(torch.abs(res.logits - want)).item() <= TOL


def test_packing_twice_changes_nothing_and_other_models_are_refused(tokenizer, monkeypatch):
    model = fresh_model("llama")
    n = pack_linears(model)
    assert n > 0 and pack_linears(model) == 0
    with pytest.raises(ConfigError, match="packed_linear.*float32 or bfloat16"):
        pack_linears(fresh_model("llama").to(torch.float16))
    monkeypatch.setenv("PROMPTCACHE_BF16", "0")  # a CPU without bfloat16 instructions
    with pytest.raises(ConfigError, match="packed_linear.*bfloat16 but turned off by PROMPTCACHE_BF16"):
        pack_linears(fresh_model("llama").to(torch.bfloat16))


def test_sibling_linears_are_packed_together_and_a_member_given_another_input_computes_afresh():
    from promptcache.models.packed import GroupMember

    stock, model = fresh_model("llama"), fresh_model("llama")
    pack_linears(model)
    attn, ref = model.model.layers[0].self_attn, stock.model.layers[0].self_attn
    assert all(isinstance(getattr(attn, n).__dict__.get("forward"), GroupMember) for n in ("q_proj", "k_proj", "v_proj"))
    mlp = model.model.layers[0].mlp
    assert all(isinstance(getattr(mlp, n).__dict__.get("forward"), GroupMember) for n in ("gate_proj", "up_proj"))
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(2, 5, attn.q_proj.in_features, generator=g), torch.randn(2, 5, attn.q_proj.in_features, generator=g)
    with torch.inference_mode():
        got = [attn.q_proj(x), attn.k_proj(y), attn.v_proj(x), attn.k_proj(x), attn.q_proj(y)]  # out of the usual order
        want = [ref.q_proj(x), ref.k_proj(y), ref.v_proj(x), ref.k_proj(x), ref.q_proj(y)]
    for a, b in zip(got, want):
        assert a.shape == b.shape and (a - b).abs().max().item() <= 1e-5 * max(1.0, b.abs().max().item())
