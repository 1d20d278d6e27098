"""OpenAI fields through the official client: logprobs equal log_softmax of the model's logits,
JSON output by constrained decoding, prompt_cache_key accepted, unsupported fields refused by name."""

from __future__ import annotations

import json

import openai
import pytest
import torch

from serverkit import MODEL

MSGS = [{"role": "user", "content": "Name three museums."}]


def reference_logprobs(pc, messages, generated: list[int]) -> torch.Tensor:
    """[n, V] log_softmax of a plain forward over the prompt and the generated tokens (the oracle)."""
    ids = pc.tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)["input_ids"]
    with torch.no_grad():
        logits = pc.model(torch.tensor([list(ids) + generated[:-1]])).logits[0, len(ids) - 1 :]
    return torch.log_softmax(logits.float(), -1)


def test_chat_logprobs_equal_log_softmax_of_the_logits(oai, pc):
    r = oai.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=5, temperature=0, logprobs=True,
                                    top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens == 5
    ids = [pc.tokenizer.convert_tokens_to_ids(pc.tokenizer.tokenize(c.token))[0] for c in content]
    ref = reference_logprobs(pc, MSGS, ids)
    for i, c in enumerate(content):
        assert c.logprob == pytest.approx(float(ref[i, ids[i]]), abs=1e-4)
        top = torch.topk(ref[i], 3)
        assert [t.logprob for t in c.top_logprobs] == pytest.approx(top.values.tolist(), abs=1e-4)
        assert c.top_logprobs[0].logprob == pytest.approx(c.logprob, abs=1e-6)  # greedy: the top one
    assert "".join(c.token for c in content) == r.choices[0].message.content
    streamed = oai.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=5, temperature=0, logprobs=True,
                                           top_logprobs=3, stream=True)
    parts = [x for ch in streamed if ch.choices and ch.choices[0].logprobs for x in ch.choices[0].logprobs.content]
    assert [p.logprob for p in parts] == pytest.approx([c.logprob for c in content], abs=1e-6)


def test_completion_logprobs_in_the_legacy_shape(oai):
    r = oai.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=4, temperature=0, logprobs=2)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 4
    assert all(len(t) <= 2 for t in lp.top_logprobs) and all(x <= 0 for x in lp.token_logprobs)
    assert lp.text_offset[0] == 0 and "".join(lp.tokens) == r.choices[0].text


def test_prompt_cache_key_is_accepted(oai):
    r = oai.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=2, prompt_cache_key="tenant-a/chat-1")
    assert r.usage.completion_tokens == 2


SCHEMA = {"type": "object", "properties": {"city": {"enum": ["Paris", "Tokyo"]}, "days": {"enum": [1, 2, 3]}},
          "required": ["city", "days"], "additionalProperties": False}


def test_json_schema_constrains_even_a_random_model(oai):
    import jsonschema

    fmt = {"type": "json_schema", "json_schema": {"name": "trip", "schema": SCHEMA}}
    r = oai.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=40, temperature=0, response_format=fmt)
    assert r.choices[0].finish_reason == "stop"  # the grammar ends, then only EOS is allowed
    jsonschema.validate(json.loads(r.choices[0].message.content), SCHEMA)
    free = oai.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=40, temperature=0)
    with pytest.raises(ValueError):  # unconstrained, the random model writes no JSON
        json.loads(free.choices[0].message.content)


@pytest.mark.parametrize("kwargs, field", [
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]}, "tools"),
    ({"logit_bias": {"5": 1}}, "logit_bias"),
    ({"presence_penalty": 0.5}, "presence_penalty"),
    ({"top_logprobs": 2}, "top_logprobs"),
    ({"messages": [{"role": "user", "content": "hi", "name": "ann"}]}, "messages.0.name"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format.json_schema"),
])
def test_unsupported_fields_are_400_naming_the_field(oai, kwargs, field):
    kwargs = {"messages": MSGS, **kwargs}
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(model=MODEL, max_tokens=2, **kwargs)
    assert e.value.body["param"] == field and field.split(".")[-1] in e.value.body["message"]
