"""Exactness of the engine against the oracle (DESIGN.md section 4), for every family."""

from __future__ import annotations

import pytest
import torch

from oracle import definition_greedy, definition_state, plain_logits
from promptcache import EngineConfig, PromptCache, RecomputeConfig
from tiny import FAMILIES, make_model, make_tokenizer

TOL = 1e-4

PREFIX_SCHEMA = """<schema name="prefix">
  <system>You are a travel planner.</system>
  <user>
    <module name="intro">Plan a trip of three days.</module>
    <module name="paris">Paris is the capital of France, famous for museums.
      <module name="cafes">Try the cafes.</module>
    </module>
    <module name="tokyo">Tokyo is a huge city in Japan with temples.</module>
  </user>
</schema>"""

PREFIX_PROMPT = """<prompt schema="prefix">
  <intro/><paris><cafes/></paris><tokyo/> Highlight the food and keep it cheap.
</prompt>"""

FULL_SCHEMA = """<schema name="full">
  <system>You are a travel planner.</system>
  <user>
    <module name="plan">Plan a trip of <parameter name="days" length="4" scaffold="three"/> days
      <module name="detail">with a day by day list</module> please.</module>
    <union scaffold="paris">
      <module name="paris">Paris is the capital of France.</module>
      <module name="tokyo">Tokyo is a huge city in Japan with temples and food markets.</module>
      <module name="rome">Rome.</module>
    </union>
    <union>
      <module name="cheap">Keep it cheap.</module>
      <module name="fancy">Money is no object: the best hotels.</module>
    </union>
    <module name="note" cache="false">Answer in one short paragraph.</module>
    <module name="who">The traveller is <parameter name="name" length="6"/>.</module>
  </user>
</schema>"""

DEFINITION_PROMPTS = {
    "union_nonscaffold_short_arg": '<prompt schema="full"><plan days="2"/><tokyo/><who name="Ann"/> Go.</prompt>',
    "full_length_arg_and_nested": '<prompt schema="full"><plan days="3 4 5 6"><detail/></plan><rome/><fancy/>'
                                  '<who name="Bob"/></prompt>',
    "empty_arg_text_between": '<prompt schema="full"><plan days=""/> Soon. <paris/> Now <note/>'
                              '<who name=""/> end</prompt>',
    "uncached_module_and_roles": '<prompt schema="full"><cheap/><note/><assistant>Sure, here</assistant></prompt>',
    "no_new_tokens": '<prompt schema="full"><paris/><fancy/></prompt>',
}


@pytest.fixture(scope="module")
def tokenizer():
    return make_tokenizer()


def _engine(family, tokenizer, schema):
    pc = PromptCache(make_model(family), tokenizer, EngineConfig(recompute=RecomputeConfig(fraction=0)))  # the definition is the splice
    pc.add_schema(schema)
    return pc


@pytest.mark.parametrize("family", FAMILIES)
def test_prefix_identity(family, tokenizer):
    pc = _engine(family, tokenizer, PREFIX_SCHEMA)
    res = pc.prefill(PREFIX_PROMPT)
    layout = pc.layout(PREFIX_PROMPT)
    assert layout.position_ids == list(range(len(layout.token_ids)))
    assert res.exact
    assert res.cached_tokens > 20 and res.new_tokens > 5
    ref = plain_logits(pc.model, layout.token_ids)
    assert torch.max(torch.abs(res.logits - ref)).item() <= TOL


@pytest.mark.parametrize("family", FAMILIES)
def test_definition_identity(family, tokenizer):
    pc = _engine(family, tokenizer, FULL_SCHEMA)
    schema = pc.schema("full").layout
    full = pc.layout(DEFINITION_PROMPTS["full_length_arg_and_nested"])
    assert len(next(s for s in full.spans if s.name == "plan.days")) == 4  # the argument fills its slot
    for name, prompt in DEFINITION_PROMPTS.items():
        res = pc.prefill(prompt)
        ref, _, _ = definition_state(pc.model, schema, pc.layout(prompt))
        diff = torch.max(torch.abs(res.logits - ref)).item()
        assert diff <= TOL, f"{name}: max abs diff {diff}"
        assert not res.exact  # placeholders, unions or gaps make these differ from a plain prefill


@pytest.mark.parametrize("family", FAMILIES)
def test_decode_identity(family, tokenizer):
    pc = _engine(family, tokenizer, FULL_SCHEMA)
    schema = pc.schema("full").layout
    prompt = DEFINITION_PROMPTS["union_nonscaffold_short_arg"]
    out = pc.generate(prompt, max_new_tokens=16, temperature=0.0)
    ref = definition_greedy(pc.model, schema, pc.layout(prompt), 16, eos=3)
    assert out.token_ids == ref
    assert out.cached_tokens > 0 and out.new_tokens > 0


@pytest.mark.parametrize("family", FAMILIES)
def test_baseline_equals_model_generate(family, tokenizer):
    pc = _engine(family, tokenizer, FULL_SCHEMA)
    prompt = DEFINITION_PROMPTS["full_length_arg_and_nested"]
    ids = pc.layout(prompt).token_ids
    out = pc.generate(prompt, max_new_tokens=16, use_cache=False)
    with torch.inference_mode():
        ref = pc.model.generate(torch.tensor([ids], device=pc.device), max_new_tokens=16, do_sample=False, eos_token_id=3,
                                pad_token_id=1)
    assert out.token_ids == ref[0, len(ids):].tolist()
