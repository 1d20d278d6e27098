"""Continuous batching: decode steps of concurrent requests run as ONE forward (``DecodeBatch``),
and greedy outputs equal the same requests served one by one, whatever joins and leaves when."""

from __future__ import annotations

import functools
import logging
import types

import pytest

from promptcache import PromptCache, SamplingParams
from promptcache.engine import PmlPrompt, Request
from promptcache.engine.scheduler import Scheduler
from promptcache.pml import parse_prompt
from promptcache.engine.batch import batch_refusal
from promptcache.models import UnsupportedModelError
from tiny import make_model, make_tokenizer

WORDS = "the cat sat on a mat while seven blue birds sang over quiet hills and rivers".split()
# 8 requests: different prompt lengths and different max tokens
SPECS = [(3 + 5 * i, 4 + (i * 7) % 13) for i in range(8)]  # (prompt words, max_new_tokens)


def prompt(i: int, words: int) -> str:
    text = " ".join(WORDS[(i + k) % len(WORDS)] for k in range(words))
    return f"<prompt><user>{text}</user></prompt>"


@functools.lru_cache(maxsize=None)
def engine(family: str) -> PromptCache:
    return PromptCache(make_model(family), make_tokenizer())


def request(pc, text, max_new_tokens):
    return Request(PmlPrompt(pc, parse_prompt(text)), SamplingParams(max_new_tokens=max_new_tokens), pc.tokenizer)


def count_forwards(pc):
    calls = []
    handle = pc.model.register_forward_hook(lambda mod, args, kwargs, out: calls.append(
        kwargs["input_ids"].shape), with_kwargs=True)
    return calls, handle


@pytest.mark.parametrize("family", ["llama", "falcon_alibi", "bloom", "gpt2"])
def test_eight_concurrent_requests_equal_one_by_one(family):
    pc = engine(family)
    assert Scheduler(pc.runner).batch_refusal is None, f"{family} should batch"
    expected = [pc.generate(prompt(i, w), max_new_tokens=m).token_ids for i, (w, m) in enumerate(SPECS)]
    assert len({len(e) for e in expected}) > 1, "the test needs requests of different lengths"

    sched = Scheduler(pc.runner)
    reqs = [request(pc, prompt(i, w), m) for i, (w, m) in enumerate(SPECS)]
    for r in reqs[:5]:  # five now, three join a batch that is already decoding
        sched.add(r)
    calls, handle = count_forwards(pc)
    try:
        steps = 0
        while sched.has_work:
            if steps == 8:
                for r in reqs[5:]:
                    sched.add(r)
            n_running = len(sched.running) if not sched.waiting else 0
            before = len(calls)
            sched.step()
            steps += 1
            if n_running >= 2:  # a decode step of several requests is one forward of all of them
                assert len(calls) - before == 1 and calls[-1][0] >= n_running
    finally:
        handle.remove()
    for r, exp in zip(reqs, expected):
        assert r.finished and r.token_ids == exp, (r.id, r.token_ids, exp)
    assert not sched.batch.members and sched.batch.cache is None


def test_rows_are_reused_and_repacked(caplog):
    pc = engine("llama")
    sched = Scheduler(pc.runner)
    long = [request(pc, prompt(i, 40), 30) for i in range(3)]
    for r in long:
        sched.add(r)
    for _ in range(6):
        sched.step()  # three prefills, three batched decodes
    assert len(sched.batch.rows) == 3 and sched.batch.repacks == 1
    long[1].cancel()
    sched.step()
    assert sched.batch.rows[1] is None and len(sched.batch.members) == 2
    late = request(pc, prompt(9, 3), 5)
    sched.add(late)
    sched.step()  # its prefill
    sched.step()  # it joins the dead row: no new buffer
    assert sched.batch.rows[1] is late and sched.batch.repacks == 1
    while late in sched.batch:
        sched.step()
    longer = request(pc, prompt(4, 90), 60)  # longer than the shared length: it grows, the others get a gap
    sched.add(longer)
    sched.step()
    capacity = sched.batch.cache.capacity
    sched.step()
    assert sched.batch.rows[1] is longer and sched.batch.repacks == 1 and sched.batch.cache.capacity > capacity
    while sched.has_work:
        sched.step()
    alone = [pc.generate(prompt(i, 40), max_new_tokens=30).token_ids for i in (0, 2)]
    assert [long[0].token_ids, long[2].token_ids] == alone
    assert late.token_ids == pc.generate(prompt(9, 3), max_new_tokens=5).token_ids
    assert longer.token_ids == pc.generate(prompt(4, 90), max_new_tokens=60).token_ids
    assert long[1].finish_reason == "cancelled" and long[1].prefill.cache is None


def test_a_request_alone_keeps_its_own_cache():
    pc = engine("llama")
    sched = Scheduler(pc.runner)
    r = request(pc, prompt(0, 10), 5)
    sched.add(r)
    sched.step()
    sched.step()
    assert not sched.batch.members and r.prefill.cache is not None
    while sched.has_work:
        sched.step()


def test_stock_cache_requests_decode_one_by_one_next_to_the_batch():
    pc = engine("llama")
    sched = Scheduler(pc.runner)
    spliced = [request(pc, prompt(i, 8), 6) for i in range(2)]
    text = prompt(5, 8)
    baseline = Request(pc.prompt_spec(text, use_cache=False), SamplingParams(max_new_tokens=6), pc.tokenizer)
    for r in [*spliced, baseline]:
        sched.add(r)
    while sched.has_work:
        sched.step()
    assert baseline.token_ids == pc.generate(text, max_new_tokens=6, use_cache=False).token_ids
    assert [r.token_ids for r in spliced] == [pc.generate(prompt(i, 8), max_new_tokens=6).token_ids for i in range(2)]


def test_a_model_without_mask_support_falls_back_and_says_so(caplog):
    class NoMasks:  # an adapter refusing custom masks, as for attn_implementation="flash_attention_2"
        def check_mask_support(self):
            raise UnsupportedModelError("custom attention masks need attn_implementation 'sdpa' or 'eager'")

    assert "sdpa" in batch_refusal(types.SimpleNamespace(adapter=NoMasks()))
    pc = engine("llama")
    sched = Scheduler(pc.runner)
    sched.batch_refusal = batch_refusal(types.SimpleNamespace(adapter=NoMasks()))
    reqs = [request(pc, prompt(i, 6), 4) for i in range(2)]
    for r in reqs:
        sched.add(r)
    with caplog.at_level(logging.INFO, logger="promptcache.engine.scheduler"):
        while sched.has_work:
            sched.step()
    assert "one forward each" in caplog.text and caplog.text.count("one forward each") == 1
    assert not sched.batch.members
    assert [r.token_ids for r in reqs] == [pc.generate(prompt(i, 6), max_new_tokens=4).token_ids for i in range(2)]
