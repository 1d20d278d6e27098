"""The host's work around a decode step is the same at every batch size: no tensor op a row.

A plain greedy decode row that takes the step's batch argmax is never indexed in the logits (its
request reads none: ``Request.reads_logits``), its own slots are never sliced (``PagedRow.own``
is made only where read), and the step's inputs, the kept plan's growth and the copies into a
static bucket are a fixed number of ops. Counted with torch.profiler on a steady decode step at
two batch sizes, through the static step (outside its forward: what a CUDA graph does not
replay) and the eager dense path (the whole step). A mixed batch (greedy, seeded sampling,
log-probabilities, EOS masked by ``min_tokens``, a stop string) gives exactly the outputs of the
same batch served with every row's logits indexed, as the scheduler did before.
"""

from __future__ import annotations

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from promptcache import PromptCache
from promptcache.engine import TokenPrompt
from promptcache.engine.decoding.sampling import SamplingParams
from promptcache.engine.serving_core import paged
from promptcache.engine.serving_core.graphs import STATIC_RANGE, CapturedSteps
from promptcache.engine.serving_core.kvpool import KVPool
from promptcache.engine.serving_core.request import Request
from promptcache.engine.serving_core.scheduler import ServingScheduler
from promptcache.kernels import attention as cpu_attention
from tiny import make_model, make_tokenizer

OUTSIDE_MOST = 40  # aten events of a static decode step outside its forward (28 when written)


@pytest.fixture
def dense(monkeypatch):
    """The path a GPU takes: no native CPU kernel, every step's attention one dense call a layer."""
    monkeypatch.setattr(cpu_attention, "gathers", lambda buf: False)


@pytest.fixture(scope="module")
def pc():
    torch.manual_seed(0)
    return PromptCache(make_model("llama"), make_tokenizer())


def aten_events(pc, batch: int, static: bool) -> tuple[int, int]:
    """(aten events of the whole step, of them outside the static forward) of the 4th decode step of
    ``batch`` greedy requests with prompts of one length."""
    steps = CapturedSteps(pc.runner, batches=(1, 2, 4, 8), width=8) if static else None
    sched = ServingScheduler(pc.runner, KVPool(pc.runner.spec, pc.device, 1024, 16), token_budget=256,
                             planner=pc.core.planner, forward=steps.forward if steps else None)
    sched.overlap = False  # a step run after the last one's tokens were read (on by default on a GPU: test_overlap.py)
    params = SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True)
    reqs = [Request(TokenPrompt((5 + i, 9, 14 + i, 3, 7, 20 + i), "ns"), params, pc.tokenizer) for i in range(batch)]
    for r in reqs:
        sched.add(r)
    for _ in range(4):  # the prefill, then three decode steps
        sched.step()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        sched.step()
    assert all(len(r.token_ids) == 5 and not r.finished for r in reqs)
    if steps is not None:
        assert steps.static_steps == 4 and steps.fallback_steps == 1  # the profiled step was static
    events = prof.events()
    inside = [(e.time_range.start, e.time_range.end) for e in events if e.name == STATIC_RANGE]
    aten = [e for e in events if e.name.startswith("aten::")]
    outside = [e for e in aten if not any(a <= e.time_range.start and e.time_range.end <= b for a, b in inside)]
    return len(aten), len(outside)


def test_a_static_decode_step_makes_the_same_ops_outside_its_forward_at_any_batch(pc, dense):
    (total_2, out_2), (_, out_8) = aten_events(pc, 2, True), aten_events(pc, 8, True)
    assert out_2 == out_8 <= OUTSIDE_MOST, (out_2, out_8)
    assert total_2 - out_2 > out_2  # most of the step is the forward a CUDA graph replays
    # rows padded up to a bucket (6 in 8): the real rows' logits sliced out of the padded ones, two more
    assert aten_events(pc, 6, True)[1] <= out_8 + 2


def test_an_eager_dense_decode_step_makes_the_same_ops_at_any_batch(pc, dense):
    assert aten_events(pc, 2, False)[0] == aten_events(pc, 6, False)[0]


def test_a_plain_greedy_row_reads_no_logits_the_others_do():
    tok = make_tokenizer()
    eos = frozenset({3})
    plain = Request(TokenPrompt((1,), "ns"), SamplingParams(temperature=0.0), tok)
    assert not plain.reads_logits(7, eos) and plain.takes_argmax(7, eos)
    assert plain.reads_logits(None, eos)  # no argmax taken: it picks from its logits
    held = Request(TokenPrompt((1,), "ns"), SamplingParams(temperature=0.0, min_tokens=2), tok)
    assert held.reads_logits(3, eos) and not held.reads_logits(7, eos)  # EOS masked while under min_tokens
    logged = Request(TokenPrompt((1,), "ns"), SamplingParams(temperature=0.0), tok, logprobs=2)
    assert logged.reads_logits(7, eos) and logged.takes_argmax(7, eos)
    sampled = Request(TokenPrompt((1,), "ns"), SamplingParams(temperature=0.8, seed=1), tok)
    assert sampled.reads_logits(7, eos) and not sampled.takes_argmax(7, eos)
    with pytest.raises(ValueError, match="needs this step's logits"):
        held.sample_next(None, eos, argmax=3)
    assert plain.sample_next(None, eos, argmax=7)[0] == 7


def mixed(pc, eos_token: int) -> list[Request]:
    tok = pc.tokenizer
    settings = [dict(temperature=0.0), dict(temperature=0.9, seed=5), dict(temperature=0.0),
                dict(temperature=0.0, min_tokens=6), dict(temperature=0.7, top_k=5, seed=2, min_tokens=4),
                dict(temperature=0.0, repetition_penalty=1.3), dict(temperature=0.0, stop=["e"])]
    logprobs = [None, 3, 2, None, 0, None, None]
    return [Request(TokenPrompt((4 + i, 11, 8, 2 + i, 17), "ns"), SamplingParams(max_new_tokens=10, **s), tok, logprobs=lp)
            for i, (s, lp) in enumerate(zip(settings, logprobs))]


def served(pc, reqs: list[Request], eos: frozenset[int]) -> list[tuple]:
    pc.runner.eos_ids, before = eos, pc.runner.eos_ids
    try:
        sched = ServingScheduler(pc.runner, KVPool(pc.runner.spec, pc.device, 1024, 16), token_budget=256,
                                 planner=pc.core.planner)
        outs = []
        for r in reqs:
            sched.add(r)
        while sched.has_work:
            outs += sched.step()
    finally:
        pc.runner.eos_ids = before
    assert all(r.error is None for r in reqs), [r.error for r in reqs]
    by_request = {}
    for o in outs:
        by_request.setdefault(o.request_id, []).append((o.token_id, o.text, o.finished, o.finish_reason, o.logprob))
    return [(r.token_ids, r.text.text, r.finish_reason, r.logprobs, by_request[r.id]) for r in reqs]


@pytest.mark.parametrize("native", [True, False])
def test_a_mixed_batch_serves_what_it_served_with_every_row_indexed(pc, native, monkeypatch):
    if not native:
        monkeypatch.setattr(cpu_attention, "gathers", lambda buf: False)
    first = served(pc, mixed(pc, frozenset()), frozenset())
    eos = frozenset({first[3][0][1]})  # the held greedy request's second token: masked under min_tokens
    got = served(pc, mixed(pc, eos), eos)
    read = []
    monkeypatch.setattr(Request, "reads_logits", lambda self, argmax, eos: read.append(self) or True)
    want = served(pc, mixed(pc, eos), eos)
    assert read  # the reference indexed every decode row
    assert got == want
    tokens = [g[0] for g in got]
    assert any(g[2] == "stop" for g in got)  # an EOS or a stop string ended one
    assert len(tokens[3]) >= 6 and eos.isdisjoint(tokens[3][:6])  # min_tokens held the EOS back
    assert all(g[3] for g, lp in zip(got, [None, 3, 2, None, 0, None, None]) if lp is not None)  # logprobs kept
