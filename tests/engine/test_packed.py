"""Packed linears (``EngineConfig.runner.packed_linear``): the engine's results stay exact against the
same (packed) model, and the packed model stays within float32 rounding of the stock one."""

from __future__ import annotations

import pytest
import torch

from oracle import plain_logits
from promptcache import EngineConfig, PromptCache, RecomputeConfig, RunnerConfig
from promptcache.errors import ConfigError
from promptcache.models.packed import PackedLinear, pack_linears
from tiny import FAMILIES, fresh_model, make_tokenizer

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


def test_packing_twice_changes_nothing_and_other_models_are_refused(tokenizer):
    model = fresh_model("llama")
    n = pack_linears(model)
    assert n > 0 and pack_linears(model) == 0
    with pytest.raises(ConfigError, match="packed_linear.*float32"):
        pack_linears(fresh_model("llama").to(torch.bfloat16))
