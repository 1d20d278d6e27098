"""The OpenAI routes through the official client: chat, streaming, completions, models, usage,
automatic prefix reuse across requests, PML and documents through ``extra_body``."""

from __future__ import annotations

import json

import openai
import pytest

from serverkit import BLOCK, MODEL, http

SYSTEM = "You are a careful assistant for a travel agency. " * 12  # ~130 tokens: several blocks


def ask(oai, messages, **kw):
    kw.setdefault("max_tokens", 6)
    return oai.chat.completions.create(model=MODEL, messages=messages, temperature=0, **kw)


def test_chat_answers_in_openai_shape(oai):
    r = ask(oai, [{"role": "user", "content": "Plan a day in Rome."}])
    choice = r.choices[0]
    assert r.object == "chat.completion" and r.model == MODEL
    assert choice.message.role == "assistant" and isinstance(choice.message.content, str)
    assert choice.finish_reason in ("stop", "length")
    u = r.usage
    assert u.completion_tokens >= 1 and u.total_tokens == u.prompt_tokens + u.completion_tokens
    assert u.prompt_tokens_details.cached_tokens >= 0


def test_text_parts_and_max_completion_tokens(oai):
    parts = [{"type": "text", "text": "Plan a day "}, {"type": "text", "text": "in Rome."}]
    a = ask(oai, [{"role": "user", "content": parts}], max_tokens=None, max_completion_tokens=3)
    b = ask(oai, [{"role": "user", "content": "Plan a day in Rome."}], max_tokens=3)
    assert a.choices[0].message.content == b.choices[0].message.content
    assert a.usage.completion_tokens == 3 and a.choices[0].finish_reason == "length"


def test_stream_equals_plain_answer_and_reports_usage(oai):
    msgs = [{"role": "user", "content": "Name three museums."}]
    plain = ask(oai, msgs, max_tokens=8)
    chunks = list(ask(oai, msgs, max_tokens=8, stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == plain.choices[0].message.content
    assert chunks[0].choices[0].delta.role == "assistant"
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals == [plain.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == plain.usage.completion_tokens


def test_stream_ends_with_done(server):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "stream": True}
    status, ctype, text = http("POST", server[0] + "/v1/chat/completions", body)
    lines = [line for line in text.splitlines() if line]
    assert status == 200 and ctype.startswith("text/event-stream")
    assert lines[-1] == "data: [DONE]" and all(line.startswith("data: ") for line in lines)
    assert json.loads(lines[-2][6:])["choices"][0]["finish_reason"] == "length"


def test_completions_plain_and_streamed(oai):
    r = oai.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=5, temperature=0)
    assert r.object == "text_completion" and r.usage.completion_tokens == 5
    streamed = oai.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=5, temperature=0,
                                      stream=True)
    assert "".join(c.choices[0].text for c in streamed if c.choices) == r.choices[0].text


def test_models_and_health(oai, server):
    assert [m.id for m in oai.models.list()] == [MODEL]
    status, _, text = http("GET", server[0] + "/health")
    assert status == 200 and json.loads(text)["status"] == "ok"


def test_second_turn_reuses_the_first(oai):
    msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Where should I go in May?"}]
    first = ask(oai, msgs)
    msgs += [{"role": "assistant", "content": first.choices[0].message.content},
             {"role": "user", "content": "And in June?"}]
    second = ask(oai, msgs)
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached >= first.usage.prompt_tokens - BLOCK  # every full block of turn 1's prompt


def test_shared_system_prompt_is_reused_by_another_request(oai):
    system = "You answer questions about trains and timetables only. " * 10
    ask(oai, [{"role": "system", "content": system}, {"role": "user", "content": "First question?"}])
    other = ask(oai, [{"role": "system", "content": system}, {"role": "user", "content": "Another one!"}])
    assert other.usage.prompt_tokens_details.cached_tokens >= BLOCK * 4


def test_ten_turn_chat_computes_only_new_tokens(oai):
    msgs = [{"role": "system", "content": "You are a chess coach. " * 8}]
    prev_prompt = 0
    for turn in range(10):
        msgs.append({"role": "user", "content": f"Turn {turn}: what next?"})
        r = ask(oai, msgs, max_tokens=4)
        computed = r.usage.prompt_tokens - r.usage.prompt_tokens_details.cached_tokens
        if turn:
            # only what this turn added (the last reply and the question) plus the partial last block
            assert computed <= r.usage.prompt_tokens - prev_prompt + BLOCK
        prev_prompt = r.usage.prompt_tokens
        msgs.append({"role": "assistant", "content": r.choices[0].message.content})


def test_pml_prompt_through_extra_body(oai):
    pml = '<prompt schema="travel"><trip days="3" travelers="two"/><tokyo/><user>Food?</user></prompt>'
    r = oai.chat.completions.create(model=MODEL, messages=[], max_tokens=4, temperature=0, extra_body={"pml": pml})
    assert r.usage.prompt_tokens_details.cached_tokens > 0
    assert r.usage.prompt_tokens > r.usage.prompt_tokens_details.cached_tokens
    c = oai.completions.create(model=MODEL, prompt="", max_tokens=4, temperature=0, extra_body={"pml": pml})
    assert c.choices[0].text == r.choices[0].message.content


def test_usage_says_exact_or_approximate_and_counts_only_served_tokens_as_cached(oai, pc):
    pml = '<prompt schema="travel"><trip days="3" travelers="two"/><tokyo/><user>Food?</user></prompt>'
    for r in ("auto", 1.0):  # a union member: drifted; 1.0 recomputes every drifted token
        want = pc.prefill(pml, recompute=r)
        got = oai.chat.completions.create(model=MODEL, messages=[], max_tokens=1, temperature=0,
                                          extra_body={"pml": pml, "recompute": r}).usage
        assert got.recomputed_tokens == want.recomputed_tokens > 0 and got.exact is False
        assert got.prompt_tokens_details.cached_tokens == want.cached_tokens - want.recomputed_tokens
    plain = oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=1).usage
    assert plain.exact is True and plain.recomputed_tokens == 0  # prefix blocks are exact
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(model=MODEL, messages=[], extra_body={"pml": pml, "recompute": "sometimes"})
    assert e.value.body["param"] == "recompute" and "'auto' or a fraction" in e.value.body["message"]


def test_documents_through_extra_body(oai, pc, docs):
    msgs = [{"role": "system", "content": "Answer from the documents."},
            {"role": "user", "content": "Which city has red gates?"}]
    expected = docs.generate("Which city has red gates?", ["kyoto", "lisbon"], system="Answer from the documents.",
                             max_new_tokens=5)
    first = ask(oai, msgs, max_tokens=5, extra_body={"documents": ["kyoto", "lisbon"]})
    r = ask(oai, msgs, max_tokens=5, extra_body={"documents": ["kyoto", "lisbon"]})
    assert first.choices[0].message.content == r.choices[0].message.content == expected.text
    # the server's store is the library's default mode with its defaults: the documents encoded at
    # add() are reused from the first request on, the same tokens recomputed as in the library
    assert docs.mode == "reuse" and not expected.exact and expected.recomputed_tokens > 0
    for res in (first, r):
        assert res.usage.prompt_tokens == expected.cached_tokens + expected.new_tokens
        assert res.usage.prompt_tokens_details.cached_tokens == expected.reused_tokens
        assert expected.reused_tokens > sum(len(docs.get(d).token_ids) for d in ("kyoto", "lisbon")) // 2
