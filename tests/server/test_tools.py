"""OpenAI tools through the official client, on a tiny random model given a Hermes-style
(Qwen2.5-like) chat template: constrained calls validate, the round trip renders through the
template, streaming reassembles to the same calls, "none" calls nothing, other templates get 400."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from serverkit import MODEL, client

WEATHER = {"type": "object", "properties": {"city": {"enum": ["Paris", "Tokyo"]}, "days": {"enum": [1, 2, 3]}},
           "required": ["city", "days"], "additionalProperties": False}
TIME = {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"],
        "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The forecast.", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": TIME}}]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
MSGS = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture
def tools_oai(tool_server):
    return client(tool_server)


def ask(oai, **kw):
    kw = {"messages": MSGS, "tools": TOOLS, "max_tokens": 120, "temperature": 0, **kw}
    kw = {k: v for k, v in kw.items() if v is not None}  # tools=None: no tools sent
    return oai.chat.completions.create(model=MODEL, **kw)


def prompt_len(pc, messages, tools=None) -> int:
    return len(pc.tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True,
                                                tokenize=True)["input_ids"])


def check_calls(choice, names=SCHEMAS) -> list:
    calls = choice.message.tool_calls
    assert calls and choice.finish_reason == "tool_calls"
    for c in calls:
        assert c.type == "function" and c.id.startswith("call_") and c.function.name in names
        jsonschema.validate(json.loads(c.function.arguments), SCHEMAS[c.function.name])
    return calls


def test_required_gives_one_valid_call_even_from_a_random_model(tools_oai, tool_pc):
    r = ask(tools_oai, tool_choice="required", parallel_tool_calls=False)
    calls = check_calls(r.choices[0])
    assert len(calls) == 1 and r.choices[0].message.content is None
    assert r.usage.prompt_tokens == prompt_len(tool_pc, MSGS, TOOLS)  # the template rendered the tools


def test_named_tool_choice_calls_that_tool(tools_oai):
    for name in SCHEMAS:
        r = ask(tools_oai, tool_choice={"type": "function", "function": {"name": name}}, parallel_tool_calls=False)
        assert [c.function.name for c in check_calls(r.choices[0], {name})] == [name]


def test_parallel_calls_each_validate(tools_oai):
    r = ask(tools_oai, tool_choice="required", max_tokens=250)
    calls = r.choices[0].message.tool_calls
    assert calls and len({c.id for c in calls}) == len(calls)
    for c in calls:
        jsonschema.validate(json.loads(c.function.arguments), SCHEMAS[c.function.name])


def test_round_trip_renders_the_calls_and_the_answer_through_the_template(tools_oai, tool_pc):
    first = ask(tools_oai, tool_choice="required", parallel_tool_calls=False)
    call = check_calls(first.choices[0])[0]
    history = MSGS + [{"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                      {"role": "tool", "tool_call_id": call.id, "content": "Sunny, 21 C."}]
    second = ask(tools_oai, messages=history, max_tokens=8)  # auto
    assert second.choices[0].finish_reason in ("stop", "length", "tool_calls")
    rendered = [MSGS[0], {"role": "assistant", "content": None, "tool_calls": [
        {"id": call.id, "type": "function",
         "function": {"name": call.function.name, "arguments": json.loads(call.function.arguments)}}]},
        history[2]]
    text = tool_pc.tokenizer.apply_chat_template(rendered, tools=TOOLS, add_generation_prompt=True, tokenize=False)
    assert "<tool_response>\nSunny, 21 C.\n</tool_response>" in text and call.function.arguments in text
    assert second.usage.prompt_tokens == prompt_len(tool_pc, rendered, TOOLS)


def test_streamed_chunks_reassemble_to_the_same_call(tools_oai):
    whole = ask(tools_oai, tool_choice="required", parallel_tool_calls=False)
    chunks = list(ask(tools_oai, tool_choice="required", parallel_tool_calls=False, stream=True))
    deltas = [ch.choices[0].delta for ch in chunks if ch.choices]
    parts = [tc for d in deltas for tc in (d.tool_calls or [])]
    assert parts and all(p.index == 0 for p in parts)
    name = "".join(p.function.name or "" for p in parts)
    arguments = "".join(p.function.arguments or "" for p in parts)
    expected = whole.choices[0].message.tool_calls[0].function
    assert (name, arguments) == (expected.name, expected.arguments)
    assert not "".join(d.content or "" for d in deltas)
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "tool_calls"


def test_none_renders_no_tools_and_parses_nothing(tools_oai, tool_pc):
    r = ask(tools_oai, tool_choice="none", max_tokens=8)
    assert r.choices[0].message.tool_calls is None and r.choices[0].finish_reason in ("stop", "length")
    assert r.usage.prompt_tokens == prompt_len(tool_pc, MSGS)


def test_auto_shows_the_tools(tools_oai, tool_pc):
    r = ask(tools_oai, max_tokens=4)
    assert r.usage.prompt_tokens == prompt_len(tool_pc, MSGS, TOOLS)
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")


@pytest.mark.parametrize("kwargs, field", [
    ({"tool_choice": "required", "tools": None}, "tool_choice"),
    ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": TOOLS + TOOLS[:1]}, "tools"),
    ({"response_format": {"type": "json_object"}}, "response_format"),
    ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools.0.function.name"),
    ({"messages": MSGS + [{"role": "assistant", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_time", "arguments": "{zone"}}]}]},
     "messages[1].tool_calls[0].function.arguments"),
    ({"messages": MSGS + [{"role": "tool", "content": "x"}]}, "messages[1].tool_call_id"),
])
def test_bad_tool_fields_are_400_naming_the_field(tools_oai, kwargs, field):
    with pytest.raises(openai.BadRequestError) as e:
        ask(tools_oai, **kwargs)
    assert e.value.body["param"] == field


def test_a_template_without_tools_is_400_naming_tools(oai):
    with pytest.raises(openai.BadRequestError) as e:
        ask(oai, tool_choice="auto")
    assert e.value.body["param"] == "tools" and "does not use 'tools'" in e.value.body["message"]
    history = MSGS + [{"role": "assistant", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_time", "arguments": "{}"}}]}]
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(model=MODEL, messages=history, max_tokens=2)
    assert e.value.body["param"] == "messages[1].tool_calls"


def test_which_templates_support_tools():
    from promptcache.models.embedded import CHAT_TEMPLATE, embedded_tokenizer
    from promptcache.server.openai.tools import unsupported
    from serverkit import HERMES_TEMPLATE

    def why(template):
        tok = embedded_tokenizer()
        tok.chat_template = template
        return unsupported(tok)

    assert why(HERMES_TEMPLATE) is None
    assert "does not use 'tools'" in why(CHAT_TEMPLATE)
    assert "renders nothing" in why("{# tools are not shown #}" + CHAT_TEMPLATE)
    xml = HERMES_TEMPLATE.replace('{"name": "{{ f.name }}", "arguments": {{ f.arguments | tojson }}}',
                                  "<function={{ f.name }}>{{ f.arguments | tojson }}</function>")
    assert xml != HERMES_TEMPLATE and "format this server does not parse" in why(xml)
