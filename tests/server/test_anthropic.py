"""POST /v1/messages through the official ``anthropic`` client: text and streamed answers, usage
with cache creation/read counts, cache_control breakpoints pinning their prefix for the TTL,
and 400s that name what is not supported."""

from __future__ import annotations

import anthropic
import pytest

from promptcache import EngineConfig, PromptCache, StoreConfig
from promptcache.models.embedded import embedded_model
from promptcache.server import create_app
from promptcache.engine import ServingConfig
from promptcache.store import Pins
from serverkit import BLOCK, MODEL, running

SYSTEM = "You are a careful assistant for a travel agency in Lisbon. " * 8  # several blocks


GREEDY = {"temperature": 0}  # this client's create() no longer takes temperature: it goes in extra_body


def client(url: str, key: str = "none") -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=url, api_key=key, max_retries=0, timeout=60)


@pytest.fixture
def ant(server):
    return client(server[0])


def cached_system(text: str, ttl: str = "5m") -> list[dict]:
    return [{"type": "text", "text": text, "cache_control": {"type": "ephemeral", "ttl": ttl}}]


def test_text_answer_in_anthropic_shape(ant, oai):
    msgs = [{"role": "user", "content": "Plan a day in Rome."}]
    r = ant.messages.create(model=MODEL, max_tokens=6, extra_body=GREEDY, messages=msgs)
    same = oai.chat.completions.create(model=MODEL, messages=msgs, max_tokens=6, temperature=0)
    assert r.type == "message" and r.role == "assistant" and r.model == MODEL
    assert [b.type for b in r.content] == ["text"] and r.content[0].text == same.choices[0].message.content
    assert r.stop_reason in ("end_turn", "max_tokens") and r.usage.output_tokens == same.usage.completion_tokens
    u = r.usage
    assert u.input_tokens + u.cache_creation_input_tokens + u.cache_read_input_tokens == same.usage.prompt_tokens


def test_two_breakpoints_create_then_read(ant):
    system = cached_system("Only answer about Porto. " + SYSTEM)
    msgs = [{"role": "user", "content": [
        {"type": "text", "text": "Here is our brochure: " + "Porto has bridges, port wine and tiles. " * 6,
         "cache_control": {"type": "ephemeral"}},
        {"type": "text", "text": "What should I see first?"}]}]
    first = ant.messages.create(model=MODEL, max_tokens=4, extra_body=GREEDY, system=system, messages=msgs)
    second = ant.messages.create(model=MODEL, max_tokens=4, extra_body=GREEDY, system=system, messages=msgs)
    a, b = first.usage, second.usage
    n = a.input_tokens + a.cache_creation_input_tokens + a.cache_read_input_tokens
    assert a.cache_read_input_tokens == 0 and a.cache_creation_input_tokens == n // BLOCK * BLOCK
    assert b.cache_read_input_tokens == (n - 1) // BLOCK * BLOCK  # the cached prefix (one token at least runs)
    assert b.cache_read_input_tokens > 4 * BLOCK and b.input_tokens + b.cache_read_input_tokens + \
        b.cache_creation_input_tokens == n
    assert second.content[0].text == first.content[0].text


def test_stream_events_in_the_api_order(ant):
    msgs = [{"role": "user", "content": "Name three museums."}]
    plain = ant.messages.create(model=MODEL, max_tokens=8, extra_body=GREEDY, messages=msgs, stop_sequences=["zzz"])
    with ant.messages.stream(model=MODEL, max_tokens=8, extra_body=GREEDY, messages=msgs,
                             stop_sequences=["zzz"]) as stream:
        kinds = [e.type for e in stream]
        final = stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    core = [k for k in kinds if k not in ("text", "ping")]
    assert core[:2] == ["message_start", "content_block_start"] and core[-3:] == [
        "content_block_stop", "message_delta", "message_stop"]
    assert set(core[2:-3]) <= {"content_block_delta"}
    assert final.content[0].text == plain.content[0].text and final.stop_reason == plain.stop_reason
    assert final.usage.output_tokens == plain.usage.output_tokens


def test_stop_sequence_is_reported(ant):
    msgs = [{"role": "user", "content": "Count."}]
    free = ant.messages.create(model=MODEL, max_tokens=12, extra_body=GREEDY, messages=msgs)
    text = free.content[0].text
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    assert stop.strip(), f"the answer {text!r} has no stretch to stop on"
    r = ant.messages.create(model=MODEL, max_tokens=12, extra_body=GREEDY, messages=msgs, stop_sequences=[stop])
    assert r.stop_reason == "stop_sequence" and r.stop_sequence == stop
    assert r.content[0].text == text[: text.index(stop)]


@pytest.mark.parametrize("extra, field", [
    ({"tools": [{"name": "f", "input_schema": {"type": "object"}}]}, "tools"),
    ({"extra_body": {"top_k": 5}}, "top_k"),
    ({"service_tier": "auto"}, "service_tier"),
    ({"thinking": {"type": "enabled", "budget_tokens": 1024}}, "thinking"),
])
def test_unsupported_fields_are_refused_by_name(ant, extra, field):
    with pytest.raises(anthropic.BadRequestError, match=field):
        ant.messages.create(model=MODEL, max_tokens=4, messages=[{"role": "user", "content": "hi"}], **extra)


def test_bad_blocks_and_too_many_breakpoints(ant):
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}
    with pytest.raises(anthropic.BadRequestError, match=r"messages\[0\]\.content\[1\]"):
        ant.messages.create(model=MODEL, max_tokens=4,
                            messages=[{"role": "user", "content": [{"type": "text", "text": "hi"}, image]}])
    five = [{"type": "text", "text": f"part {i}. ", "cache_control": {"type": "ephemeral"}} for i in range(5)]
    with pytest.raises(anthropic.BadRequestError, match="at most 4"):
        ant.messages.create(model=MODEL, max_tokens=4, messages=[{"role": "user", "content": five}])


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture(scope="module")
def pressured(tmp_path_factory):
    """An engine whose KV pool holds 32 blocks and whose store's memory 16, a pin budget of 12
    blocks, and a fake clock."""
    model, tok = embedded_model(MODEL)
    probe = PromptCache(model, tok)
    block = BLOCK * probe.runner.stored_spec.bytes_per_token
    pc = PromptCache(model, tok, EngineConfig(store=StoreConfig(host_budget=16 * block, spill_dir=str(tmp_path_factory.mktemp("spill")))))
    clock = Clock()
    app = create_app(pc, model_name=MODEL, block_size=BLOCK, pins=Pins(12 * block, clock=clock),
                     serving=ServingConfig(kv_pool_tokens=32 * BLOCK))
    with running(app) as url:
        yield client(url), pc, app, clock


def test_pinned_prefix_survives_pressure_until_its_ttl(pressured):
    ant, pc, app, clock = pressured
    system = cached_system("Pinned: answer about Madeira. " + SYSTEM)
    msgs = [{"role": "user", "content": "Hello?"}]
    ant.messages.create(model=MODEL, max_tokens=2, extra_body=GREEDY, system=system, messages=msgs)
    prefix = app.state.prefix
    rendered = pc.tokenizer.apply_chat_template([{"role": "system", "content": system[0]["text"]}], tokenize=False)
    ids = pc.tokenizer(rendered, add_special_tokens=False).input_ids
    keys = prefix.keys(ids, pc.config.namespace)[:-1]  # whole blocks of the system turn (its last may be cut)
    pool = app.state.backend.pool
    assert keys and all(k in pool for k in keys)

    def pressure(tag: str):
        for i in range(3):  # each ~11 new blocks, 33 in all: twice the memory budget
            ant.messages.create(model=MODEL, max_tokens=1, extra_body=GREEDY,
                                messages=[{"role": "user", "content": f"{tag} {i}. " + SYSTEM}])

    pressure("before")
    assert pool.evictions > 0 and all(k in pool for k in keys)  # pinned: kept in the pool under pressure
    clock.now += 301  # past the 5 minute TTL
    pressure("after")
    assert any(k not in pool for k in keys)  # no longer pinned: evicted as usual, down to the store
    again = ant.messages.create(model=MODEL, max_tokens=2, extra_body=GREEDY, system=system, messages=msgs)
    assert again.usage.cache_read_input_tokens >= len(keys) * BLOCK  # still served, from disk


def test_pins_past_the_budget_are_refused(pressured):
    ant, pc, app, clock = pressured
    clock.now += 4000  # every earlier pin has expired
    long = cached_system("Too long to pin. " + SYSTEM * 2, ttl="1h")  # ~22 blocks > the 12-block budget
    with pytest.raises(anthropic.BadRequestError, match="pin budget"):
        ant.messages.create(model=MODEL, max_tokens=2, system=long, messages=[{"role": "user", "content": "hi"}])


def test_top_level_cache_control_pins_the_whole_prompt(ant, pc):
    before = len(pc.store.pins)
    msgs = [{"role": "user", "content": "Automatic caching of everything. " + SYSTEM}]
    ant.messages.create(model=MODEL, max_tokens=2, extra_body=GREEDY, messages=msgs,
                        cache_control={"type": "ephemeral", "ttl": "1h"})
    n = len(pc.tokenizer.apply_chat_template(msgs, tokenize=True, add_generation_prompt=True)["input_ids"])
    assert len(pc.store.pins) - before >= (n - 8) // BLOCK  # every full block up to the last message's end


def test_x_api_key_selects_the_tenant(pc):
    app = create_app(pc, api_keys={"k-ant": "ant-tenant"}, model_name=MODEL, block_size=BLOCK)
    with running(app) as url:
        r = client(url, "k-ant").messages.create(model=MODEL, max_tokens=2, messages=[{"role": "user", "content": "hi"}])
        assert r.usage.output_tokens >= 1
        with pytest.raises(anthropic.AuthenticationError, match="API key"):
            client(url, "wrong").messages.create(model=MODEL, max_tokens=2, messages=[{"role": "user", "content": "hi"}])
