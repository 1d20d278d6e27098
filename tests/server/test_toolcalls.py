"""Tool-call parsing (``server.toolcalls``): the Hermes ``<tool_call>`` blocks, whole and streamed."""

from __future__ import annotations

import json
import logging

import pytest

from promptcache.server.openai.toolcalls import CallStream, ToolCall, parse

CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n</tool_call>'
OTHER = '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'


def streamed(text: str, step: int) -> tuple[str | None, list[ToolCall]]:
    """(content, calls) put together from ``text`` fed ``step`` characters at a time."""
    s, pieces = CallStream(), []
    for i in range(0, len(text), step):
        pieces += s.feed(text[i:i + step])
    pieces += s.close()
    calls = [p for p in pieces if isinstance(p, ToolCall)]
    assert calls == s.calls
    return "".join(p for p in pieces if isinstance(p, str)) or None, calls


def test_one_call_no_text():
    content, calls = parse(CALL)
    assert content is None and len(calls) == 1
    assert calls[0].name == "get_weather" and json.loads(calls[0].arguments) == {"city": "Paris", "days": 2}
    assert calls[0].id.startswith("call_") and len(calls[0].id) == 29
    assert calls[0].openai(1) == {"index": 1, "id": calls[0].id, "type": "function",
                                  "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 2}'}}


def test_several_calls_with_text_around_them():
    content, calls = parse("Let me look.\n" + CALL + "\n" + OTHER + "\nDone.")
    assert [c.name for c in calls] == ["get_weather", "get_time"]
    assert content == "Let me look.\n\n\nDone."  # the text outside the calls, its ends stripped
    assert len({c.id for c in calls}) == 2


def test_malformed_blocks_stay_content_and_are_logged(caplog):
    bad_json = '<tool_call>\n{"name": "f", "arguments": {"a": 1}\n</tool_call>'  # one brace short
    no_args = '<tool_call>\n{"name": "f"}\n</tool_call>'
    with caplog.at_level(logging.WARNING, logger="promptcache.server.openai.toolcalls"):
        content, calls = parse("a " + bad_json + " b " + no_args + " " + CALL)
    assert [c.name for c in calls] == ["get_weather"]
    assert content == "a " + bad_json + " b " + no_args
    assert len([r for r in caplog.records if "kept as content" in r.message]) == 2


def test_an_open_block_at_the_end():
    assert parse(CALL[: -len("\n</tool_call>")])[1][0].name == "get_weather"  # stopped before the closing tag
    assert parse(CALL[:-3])[1][0].name == "get_weather"  # or within it
    cut = CALL[:30]
    assert parse("x " + cut) == ("x " + cut, [])  # cut inside the JSON: content
    assert parse("x <tool_") == ("x <tool_", [])  # a tag start at the end is text after all


@pytest.mark.parametrize("step", [1, 2, 3, 7, 1000])
def test_streamed_pieces_put_together_equal_the_parse(step):
    text = "  Let me look.\n" + CALL + "\n" + OTHER + "\n<tool_call>{oops}</tool_call> <tool_ and more \n"
    content, calls = parse(text)
    s_content, s_calls = streamed(text, step)
    assert s_content == content == "Let me look.\n\n\n<tool_call>{oops}</tool_call> <tool_ and more"
    assert [(c.name, c.arguments) for c in s_calls] == [(c.name, c.arguments) for c in calls]


def test_text_that_may_open_a_tag_is_held_back():
    s = CallStream()
    assert s.feed("Hi <tool") == ["Hi"]  # the space is held too: it may end the content
    assert s.feed("_call>\n{\"name\": \"f\", ") == []
    out = s.feed('"arguments": {}}\n</tool_call>')
    assert len(out) == 1 and out[0].name == "f"
    assert s.feed(" <b>") == ["  <b>"] and s.close() == []  # the held space comes with the next text
