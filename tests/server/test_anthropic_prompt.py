"""Breakpoints land right after their block's text, as a true prefix of the prompt's IDs, also
when the template trims the text before the breakpoint."""

from __future__ import annotations

import pytest

from promptcache.server.anthropic.prompt import render
from promptcache.server.anthropic.protocol import AnthropicError, MessagesRequest
from tiny import make_tokenizer

EPH = {"type": "ephemeral"}


def request(**kw) -> MessagesRequest:
    return MessagesRequest.model_validate({"model": "m", "max_tokens": 3, **kw})


def test_breakpoints_end_their_blocks():
    tok = make_tokenizer()
    r = render(tok, request(
        system=[{"type": "text", "text": "You are a travel planner.", "cache_control": EPH}],
        messages=[{"role": "user", "content": [
            {"type": "text", "text": "Paris is the capital.", "cache_control": {"type": "ephemeral", "ttl": "1h"}},
            {"type": "text", "text": " Keep it cheap."}]}]))
    assert [(b.where, b.ttl) for b in r.breakpoints] == [("system[0]", 300.0), ("messages[0].content[0]", 3600.0)]
    heads = [tok.decode(r.ids[: b.tokens]) for b in r.breakpoints]
    assert heads[0].endswith("You are a travel planner.") and heads[1].endswith("Paris is the capital.")
    assert r.ids == tok(tok.apply_chat_template(
        [{"role": "system", "content": "You are a travel planner."},
         {"role": "user", "content": "Paris is the capital. Keep it cheap."}],
        tokenize=False, add_generation_prompt=True), add_special_tokens=False).input_ids


def test_a_trimming_template_moves_the_breakpoint_back_never_forward():
    tok = make_tokenizer()
    tok = tok.__class__(tokenizer_object=tok.backend_tokenizer, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                        unk_token="<unk>")
    tok.chat_template = ("{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] | trim }}<|end|>\n{% endfor %}"
                         "<|assistant|>\n")
    r = render(tok, request(messages=[{"role": "user", "content": [
        {"type": "text", "text": "Keep it cheap.  ", "cache_control": EPH}]}]))
    head = tok.decode(r.ids[: r.breakpoints[0].tokens])
    assert "Keep it cheap." in head and "<|end|>" not in head


def test_last_message_from_the_assistant_is_continued():
    tok = make_tokenizer()
    r = render(tok, request(messages=[{"role": "user", "content": "Plan a trip."},
                                      {"role": "assistant", "content": "Day one:"}]))
    assert tok.decode(r.ids).endswith("Day one:")


def test_an_unknown_block_field_is_named():
    with pytest.raises(AnthropicError, match=r"messages\[0\]\.content\[0\]\.citations"):
        render(make_tokenizer(), request(messages=[{"role": "user", "content": [
            {"type": "text", "text": "hi", "citations": []}]}]))
