"""Requests, the step() scheduler and the stream built on it: order, finish reasons, usage,
cancellation, and that every cache goes back to the pool exactly once."""

from __future__ import annotations


import pytest

from promptcache import PromptCache, SamplingParams
from promptcache.engine import PmlPrompt, PromptSpec, Request
from promptcache.engine.scheduler import Scheduler
from promptcache.pml import parse_prompt
from tiny import make_model, make_tokenizer

SCHEMA = """<schema name="s">
  <system>You are a travel planner.</system>
  <user>
    <module name="plan">Plan a trip of <parameter name="days" length="3"/> days.</module>
    <module name="paris">Paris is the capital of France.</module>
  </user>
</schema>"""
PROMPTS = ['<prompt schema="s"><plan days="3"/><paris/> Highlight the food.</prompt>',
           '<prompt schema="s"><paris/> Keep it cheap.</prompt>']


@pytest.fixture
def pc(monkeypatch):
    engine = PromptCache(make_model("llama"), make_tokenizer())
    engine.add_schema(SCHEMA)
    engine.released = []
    release = engine.runner.release
    monkeypatch.setattr(engine.runner, "release", lambda cache: (engine.released.append(cache), release(cache)))
    return engine


def request(pc, prompt, **kw):
    return Request(PmlPrompt(pc, parse_prompt(prompt)), SamplingParams(**kw), pc.tokenizer)


def test_two_requests_step_together_and_match_generate(pc):
    expected = [pc.generate(p, max_new_tokens=6) for p in PROMPTS]
    pc.released.clear()
    sched = Scheduler(pc.runner)
    reqs = [request(pc, p, max_new_tokens=6) for p in PROMPTS]
    for r in reqs:
        sched.add(r)
    steps = []
    while sched.has_work:
        steps.append(sched.step())
    assert [[o.request_id for o in s] for s in steps[:3]] == [[reqs[0].id], [reqs[1].id], [reqs[0].id, reqs[1].id]]
    for r, exp in zip(reqs, expected):
        outs = [o for s in steps for o in s if o.request_id == r.id]
        assert [o.token_id for o in outs] == exp.token_ids
        assert "".join(o.text for o in outs) == exp.text
        assert [o.finished for o in outs] == [False] * 5 + [True] and outs[-1].finish_reason == "length"
        assert r.generation().token_ids == exp.token_ids and r.prefill.cache is None
    assert len(pc.released) == 2 and pc.released[0] is not pc.released[1]


def test_cancel_releases_the_cache_at_the_next_step(pc):
    sched = Scheduler(pc.runner)
    running, waiting = request(pc, PROMPTS[0], max_new_tokens=20), request(pc, PROMPTS[1], max_new_tokens=20)
    sched.add(running)
    sched.add(waiting)
    sched.step()  # prefill of the first
    cache = running.prefill.cache
    running.cancel()
    waiting.cancel()
    outs = sched.step()
    assert {(o.request_id, o.token_id, o.finished, o.finish_reason) for o in outs} == {
        (running.id, None, True, "cancelled"), (waiting.id, None, True, "cancelled")}
    assert not sched.has_work and pc.released == [cache] and waiting.prefill is None
    with pytest.raises(ValueError, match="only a new request can be added"):
        sched.add(running)


def test_leaving_a_stream_early_releases_its_cache(pc):
    stream = pc.stream(PROMPTS[0], max_new_tokens=30)
    for _ in stream:
        break
    assert len(pc.released) == 1 and stream.request.finish_reason == "cancelled" and stream.result is None


def test_finish_reasons_and_usage(pc):
    out = pc.generate(PROMPTS[0], max_new_tokens=8)
    layout = pc.layout(PROMPTS[0])
    assert out.finish_reason == "length" and len(out.token_ids) == 8
    u = out.usage
    assert (u.prompt_tokens, u.completion_tokens, u.cached_tokens, u.total_tokens) == (
        len(layout.token_ids), 8, out.cached_tokens - out.recomputed_tokens, len(layout.token_ids) + 8)
    stop = out.text[3:5]
    cut = pc.generate(PROMPTS[0], max_new_tokens=8, stop=[stop])
    assert cut.finish_reason == "stop" and stop not in cut.text and out.text.startswith(cut.text)
    pc.runner.eos_ids = frozenset({out.token_ids[2]})  # make the third greedy token the EOS
    eos = pc.generate(PROMPTS[0], max_new_tokens=8)
    assert eos.finish_reason == "stop" and eos.token_ids == out.token_ids[: out.token_ids.index(out.token_ids[2]) + 1]
    none = pc.generate(PROMPTS[0], max_new_tokens=0)
    assert none.token_ids == [] and none.text == "" and none.finish_reason == "length"
    assert none.usage.prompt_tokens == len(layout.token_ids) and none.usage.completion_tokens == 0
    assert len(pc.released) == 4  # every generation gave its buffer back once


def test_a_failing_prefill_leaves_nothing_held(pc):
    class Broken(PromptSpec):
        def prefill(self, reserve=0):
            raise RuntimeError("boom")

    sched = Scheduler(pc.runner)
    req = Request(Broken(), SamplingParams(max_new_tokens=3), pc.tokenizer)
    sched.add(req)
    with pytest.raises(RuntimeError, match="boom"):
        sched.step()
    assert req.finished and not sched.has_work
