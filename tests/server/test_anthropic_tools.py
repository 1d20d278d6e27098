"""Anthropic tools on /v1/messages through the official ``anthropic`` client, on the embedded
model given a Hermes-style template: tool_use blocks that validate, stop_reason "tool_use", the
round trip with tool_result, streamed blocks, cache_control on a tool_result, and the refusals."""

from __future__ import annotations

import jsonschema
import anthropic
import pytest

from serverkit import MODEL

WEATHER = {"type": "object", "properties": {"city": {"enum": ["Paris", "Tokyo"]}, "days": {"enum": [1, 2, 3]}},
           "required": ["city", "days"], "additionalProperties": False}
TIME = {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"],
        "additionalProperties": False}
TOOLS = [{"name": "get_weather", "description": "The forecast.", "input_schema": WEATHER},
         {"name": "get_time", "input_schema": TIME}]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
MSGS = [{"role": "user", "content": "What is the weather in Paris?"}]
GREEDY = {"temperature": 0}


@pytest.fixture
def ant_tools(tool_server):
    return anthropic.Anthropic(base_url=tool_server, api_key="none", max_retries=0, timeout=60)


def ask(client, **kw):
    kw = {"messages": MSGS, "tools": TOOLS, "max_tokens": 120, "extra_body": GREEDY, **kw}
    return client.messages.create(model=MODEL, **kw)


def tool_uses(r, names=SCHEMAS) -> list:
    uses = [b for b in r.content if b.type == "tool_use"]
    assert uses and r.stop_reason == "tool_use"
    for u in uses:
        assert u.id.startswith("toolu_") and u.name in names
        jsonschema.validate(u.input, SCHEMAS[u.name])
    return uses


def test_any_and_named_choices_give_valid_tool_use_blocks(ant_tools):
    r = ask(ant_tools, tool_choice={"type": "any", "disable_parallel_tool_use": True})
    assert len(tool_uses(r)) == 1 and [b.type for b in r.content] == ["tool_use"]
    r = ask(ant_tools, tool_choice={"type": "tool", "name": "get_time", "disable_parallel_tool_use": True})
    assert [u.name for u in tool_uses(r, {"get_time"})] == ["get_time"]


def test_round_trip_with_a_cached_tool_result(ant_tools, tool_pc):
    first = ask(ant_tools, tool_choice={"type": "any", "disable_parallel_tool_use": True})
    use = tool_uses(first)[0]
    result = {"type": "tool_result", "tool_use_id": use.id, "content": "Sunny, 21 C. " * 8,
              "cache_control": {"type": "ephemeral"}}
    history = MSGS + [{"role": "assistant", "content": first.content},  # as clients send it back
                      {"role": "user", "content": [result]}]
    second = ask(ant_tools, messages=history, max_tokens=6)
    third = ask(ant_tools, messages=history, max_tokens=6)
    assert second.stop_reason in ("end_turn", "max_tokens", "tool_use")
    rendered = [MSGS[0], {"role": "assistant", "content": "", "tool_calls": [
        {"id": use.id, "type": "function", "function": {"name": use.name, "arguments": use.input}}]},
        {"role": "tool", "content": result["content"], "tool_call_id": use.id}]
    functions = [{"type": "function", "function": {"name": t["name"], **({"description": t["description"]}
                                                                           if "description" in t else {}),
                                                   "parameters": t["input_schema"]}} for t in TOOLS]
    ids = tool_pc.tokenizer.apply_chat_template(rendered, tools=functions, add_generation_prompt=True,
                                                tokenize=True)["input_ids"]
    u = third.usage
    assert u.input_tokens + u.cache_creation_input_tokens + u.cache_read_input_tokens == len(ids)
    assert u.cache_read_input_tokens > 0  # the prefix up to the tool result was stored and read


def test_streamed_blocks_match_the_whole_answer(ant_tools):
    choice = {"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True}
    whole = ask(ant_tools, tool_choice=choice)
    with ant_tools.messages.stream(model=MODEL, messages=MSGS, tools=TOOLS, max_tokens=120, extra_body=GREEDY,
                                   tool_choice=choice) as s:
        streamed = s.get_final_message()
    assert [(b.type, b.name, b.input) for b in streamed.content] == [(b.type, b.name, b.input) for b in whole.content]
    assert streamed.stop_reason == "tool_use"


def test_none_and_auto(ant_tools):
    r = ask(ant_tools, tool_choice={"type": "none"}, max_tokens=6)
    assert [b.type for b in r.content] == ["text"] and r.stop_reason in ("end_turn", "max_tokens")
    auto = ask(ant_tools, max_tokens=6)
    assert auto.usage.input_tokens + auto.usage.cache_creation_input_tokens + auto.usage.cache_read_input_tokens \
        > r.usage.input_tokens + r.usage.cache_creation_input_tokens + r.usage.cache_read_input_tokens  # tools shown


@pytest.mark.parametrize("kw, where", [
    ({"tool_choice": {"type": "tool", "name": "nope"}}, "tool_choice.name"),
    ({"tools": [{**TOOLS[0], "cache_control": {"type": "ephemeral"}}]}, r"tools\[0\]\.cache_control"),
    ({"messages": MSGS + [{"role": "assistant", "content": [
        {"type": "tool_use", "id": "toolu_1", "name": "get_time", "input": {}, "cache_control": {"type": "ephemeral"}}]}]},
     r"messages\[1\]\.content\[0\]\.cache_control"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_use", "id": "t", "name": "get_time", "input": {}}]}]},
     r"messages\[0\]\.content\[0\]"),
])
def test_bad_tool_fields_are_refused_by_name(ant_tools, kw, where):
    with pytest.raises(anthropic.BadRequestError, match=where):
        ask(ant_tools, **kw)


def test_a_template_without_tools_refuses_them(server):
    plain = anthropic.Anthropic(base_url=server[0], api_key="none", max_retries=0, timeout=60)
    with pytest.raises(anthropic.BadRequestError, match="does not use 'tools'"):
        ask(plain)
    history = MSGS + [{"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": {}}]}]
    with pytest.raises(anthropic.BadRequestError, match=r"messages\[1\]\.content\[0\]"):
        plain.messages.create(model=MODEL, max_tokens=2, messages=history)


def test_a_tool_result_breakpoint_ends_after_its_text(tool_pc):
    from promptcache.server.anthropic.prompt import render
    from promptcache.server.anthropic.protocol import MessagesRequest

    use = {"type": "tool_use", "id": "toolu_1", "name": "get_time", "input": {"zone": "UTC"}}
    result = {"type": "tool_result", "tool_use_id": "toolu_1", "content": "It is noon.", "is_error": True,
              "cache_control": {"type": "ephemeral", "ttl": "1h"}}
    req = MessagesRequest.model_validate({"model": MODEL, "max_tokens": 4, "tools": TOOLS, "messages": MSGS + [
        {"role": "assistant", "content": [{"type": "text", "text": "Let me see."}, use]},
        {"role": "user", "content": [result, {"type": "text", "text": "And tomorrow?"}]}]})
    prompt = render(tool_pc.tokenizer, req)
    text = tool_pc.tokenizer.decode(prompt.ids)
    assert 'Let me see.\n<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool_call>' in text
    assert text.index("Error: It is noon.") < text.index("And tomorrow?")  # the result, then the user's text
    [bp] = prompt.breakpoints
    assert (bp.where, bp.ttl) == ("messages[2].content[0]", 3600.0)
    assert tool_pc.tokenizer.decode(prompt.ids[: bp.tokens]).endswith("Error: It is noon.")


def test_stream_events_open_a_block_per_text_run_and_per_call():
    import json

    from promptcache.server.anthropic.tools import ToolEvents

    def kinds(events):
        out = []
        for e in events:
            data = json.loads(e.split("data: ", 1)[1])
            block = data.get("content_block") or data.get("delta") or {}
            out.append((data["type"], data["index"], block.get("type")))
        return out

    s = ToolEvents()
    events = s.feed("Let me check. <tool_") + s.feed('call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n'
                                                     "</tool_call>") + s.close()
    assert kinds(events) == [("content_block_start", 0, "text"), ("content_block_delta", 0, "text_delta"),
                             ("content_block_stop", 0, None), ("content_block_start", 1, "tool_use"),
                             ("content_block_delta", 1, "input_json_delta"), ("content_block_stop", 1, None)]
    assert '"partial_json": "{\\"zone\\": \\"UTC\\"}"' in events[4]
    empty = ToolEvents()
    assert kinds(empty.feed("") + empty.close()) == [("content_block_start", 0, "text"), ("content_block_stop", 0, None)]
