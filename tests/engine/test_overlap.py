"""Overlapped decode (``ServingScheduler.overlap``, ``tunables.OVERLAP_STEPS``).

A steady greedy decode batch launches its next step, whose input ids are this step's argmax on the
device, before the host reads this step's tokens; the host then reads them, checks stops and
streams while the device computes (on a GPU). On a CPU the order changes, not the work: every test
here runs both ways and asks for the same outputs (tokens, text pieces, finish reasons, in order),
the oracle's greedy tokens, and the pool left as without the overlap, across what ends or changes a
batch mid-flight: a request stopping on an end-of-sequence token or a stop string (its row of the
step launched ahead is dropped), reaching its length, being cancelled, a request arriving, one
sampling, recording log-probabilities or masking end-of-sequence tokens beside them.
"""

from __future__ import annotations

import pytest
import torch

from promptcache import tunables
from promptcache.engine.decoding.sampling import SamplingParams
from promptcache.engine.serving_core import paged
from promptcache.engine.serving_core.kvpool import KVPool
from promptcache.engine.serving_core.request import Request
from promptcache.engine.serving_core.scheduler import AHEAD, ServingScheduler
from test_serving import engine, pml
from tiny import make_tokenizer
from trip import PROMPTS

GREEDY = dict(temperature=0.0)


def run(pc, specs, overlap: bool, events=None, forward=None):
    """Serve ``specs`` ((prompt, SamplingParams, logprobs) each; None: added by ``events``) to the end.
    ``events``: step number -> callable(sched, reqs) run before that step. Returns (requests, every
    step's outputs as (request index, token, text, finished, reason), scheduler)."""
    pool = KVPool(pc.runner.spec, pc.device, 2048, 16)
    sched = ServingScheduler(pc.runner, pool, token_budget=64, planner=pc.core.planner, forward=forward)
    sched.overlap = overlap
    reqs = []
    for prompt, params, logprobs in specs:
        reqs.append(Request(pml(pc, prompt), params, pc.tokenizer, logprobs=logprobs))
        sched.add(reqs[-1])
    index = {r.id: i for i, r in enumerate(reqs)}
    outs, n = [], 0
    while sched.has_work or (events and any(k >= n for k in events)):
        if events and n in events:
            events[n](sched, reqs, index)
        for o in sched.step():
            outs.append((index[o.request_id], o.token_id, o.text, o.finished, o.finish_reason))
        n += 1
        assert n < 200
    return reqs, outs, sched


def per_request(outs):
    """Each request's outputs in order (the interleaving across requests may differ by a step)."""
    got: dict[int, list] = {}
    for o in outs:
        got.setdefault(o[0], []).append(o[1:])
    return got


def assert_same(a, b):
    reqs_a, outs_a, sched_a = a
    reqs_b, outs_b, sched_b = b
    assert per_request(outs_a) == per_request(outs_b)
    assert [r.token_ids for r in reqs_a] == [r.token_ids for r in reqs_b]
    assert [r.finish_reason for r in reqs_a] == [r.finish_reason for r in reqs_b]
    assert all(r.error is None for r in reqs_a + reqs_b)
    assert sched_a.pool.free_blocks == sched_b.pool.free_blocks  # nothing held past its request
    assert not sched_a.running and not sched_b.running


@pytest.fixture(params=[True, False], ids=["native", "dense"])
def native(request, monkeypatch):
    if not request.param:  # the path a GPU takes
        monkeypatch.setattr(paged.cpu_attention, "gathers", lambda buf: False)
    return request.param


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_a_greedy_batch_overlapped_decodes_the_oracle_s_tokens_and_outputs(family, native):
    """Three greedy requests (10, 4 and 10 tokens): the next step is launched ahead at every step
    but the one where a request reaches its length, the outputs are those of the steps run one
    after the other, and each request's tokens the oracle's."""
    from oracle import definition_greedy

    pc = engine(family, make_tokenizer())
    specs = [(p, SamplingParams(max_new_tokens=n, ignore_eos=True, **GREEDY), None) for p, n in zip(PROMPTS, (10, 4, 10))]
    plain, overlapped = run(pc, specs, False), run(pc, specs, True)
    assert_same(plain, overlapped)
    schema = pc.schema("trip").layout
    for prompt, req in zip(PROMPTS, overlapped[0]):
        assert req.token_ids == definition_greedy(pc.model, schema, pc.layout(prompt), len(req.token_ids)), prompt
    # 9 decode steps, each but the last launched ahead of the one before (the request of 4 tokens
    # is left out of the step after its last)
    assert plain[2].ahead_steps == 0 and overlapped[2].ahead_steps == 8
    # the steps launched ahead read their ids from the device: the host's copy is only a placeholder
    assert overlapped[2].device_id_steps >= overlapped[2].ahead_steps


def test_requests_stopping_on_an_end_of_sequence_token_or_a_stop_string_drop_their_row_launched_ahead(native):
    """One request stops on a token made an end-of-sequence token, one on a stop string, mid-batch:
    the step launched ahead with them computed their rows for nothing; the outputs are the plain
    run's, and the other request decodes on."""
    pc = engine("llama", make_tokenizer())
    base = run(pc, [(p, SamplingParams(max_new_tokens=12, **GREEDY), None) for p in PROMPTS[:3]], False)[0]
    text = pc.tokenizer.decode(base[1].token_ids)
    stop = text[len(text) // 2: len(text) // 2 + 3]
    assert stop.strip()
    pc.runner.eos_ids = frozenset({base[0].token_ids[4]})  # request 0 stops at its 5th token
    specs = [(PROMPTS[0], SamplingParams(max_new_tokens=12, **GREEDY), None),
             (PROMPTS[1], SamplingParams(max_new_tokens=12, stop=(stop,), **GREEDY), None),
             (PROMPTS[2], SamplingParams(max_new_tokens=12, ignore_eos=True, **GREEDY), None)]
    plain, overlapped = run(pc, specs, False), run(pc, specs, True)
    assert_same(plain, overlapped)
    reqs = overlapped[0]
    assert reqs[0].finish_reason == "stop" and len(reqs[0].token_ids) <= 5
    assert reqs[1].finish_reason == "stop" and stop in reqs[1].text.text + pc.tokenizer.decode(reqs[1].token_ids)
    assert reqs[2].finish_reason == "length" and len(reqs[2].token_ids) == 12
    assert overlapped[2].ahead_steps >= 6


def test_a_request_cancelled_or_arriving_mid_flight_is_handled_as_without_the_overlap(native):
    """A request cancelled while a step with it runs ahead, and one arriving mid-run (the chain of
    steps launched ahead stops for its admission): each request's outputs are the plain run's."""
    pc = engine("llama", make_tokenizer())
    late = (PROMPTS[2], SamplingParams(max_new_tokens=6, **GREEDY), None)

    def cancel(sched, reqs, index):
        reqs[1].cancel()

    def arrive(sched, reqs, index):
        reqs.append(Request(pml(pc, late[0]), late[1], pc.tokenizer))
        index[reqs[-1].id] = len(reqs) - 1
        sched.add(reqs[-1])

    specs = [(PROMPTS[0], SamplingParams(max_new_tokens=14, ignore_eos=True, **GREEDY), None),
             (PROMPTS[1], SamplingParams(max_new_tokens=14, ignore_eos=True, **GREEDY), None)]
    events = {4: cancel, 6: arrive}
    plain, overlapped = run(pc, specs, False, dict(events)), run(pc, specs, True, dict(events))
    assert per_request(plain[1])[0] == per_request(overlapped[1])[0]
    assert plain[0][1].finish_reason == overlapped[0][1].finish_reason == "cancelled"
    # cancelled before the same step: as many tokens either way
    assert plain[0][1].token_ids == overlapped[0][1].token_ids
    assert plain[0][2].token_ids == overlapped[0][2].token_ids and len(plain[0][2].token_ids) == 6
    assert plain[2].pool.free_blocks == overlapped[2].pool.free_blocks
    assert overlapped[2].ahead_steps >= 4


def test_no_step_is_launched_ahead_beside_a_request_that_samples_records_logprobs_or_masks_eos(native):
    """Beside a request whose next token is not its argmax (seeded sampling), or that records
    log-probabilities, or still masks end-of-sequence tokens (min_tokens), the steps run one after
    the other; once the masking is over, they are launched ahead again. Outputs as the plain run's."""
    pc = engine("llama", make_tokenizer())
    greedy = (PROMPTS[0], SamplingParams(max_new_tokens=8, ignore_eos=True, **GREEDY), None)
    for other in [(PROMPTS[1], SamplingParams(max_new_tokens=8, temperature=0.8, seed=5), None),
                  (PROMPTS[1], SamplingParams(max_new_tokens=8, **GREEDY), 3)]:
        plain, overlapped = run(pc, [greedy, other], False), run(pc, [greedy, other], True)
        assert_same(plain, overlapped)
        assert overlapped[2].ahead_steps == 0
        if other[2]:
            assert [e.token_id for e in overlapped[0][1].logprobs] == overlapped[0][1].token_ids
    masking = (PROMPTS[1], SamplingParams(max_new_tokens=10, min_tokens=5, **GREEDY), None)
    plain, overlapped = run(pc, [greedy, masking], False), run(pc, [greedy, masking], True)
    assert_same(plain, overlapped)
    assert 0 < overlapped[2].ahead_steps <= 4  # from the 5th token on


def test_the_host_ids_of_a_step_launched_ahead_are_set_once_read_and_its_blocks_shared_then():
    """A chain request's own blocks are shared under keys of their tokens: a block completed by a
    step launched ahead is shared once its placeholder id was replaced by the token read back, so
    the keys are the ones a plain run shares, and a later request over the same tokens reuses them."""
    from test_serving import tokens

    pc = engine("llama", make_tokenizer())
    seen = []

    def forward(pool, rows):
        seen.extend(t for r in rows for t in r.ids)
        return paged.paged_forward(pc.runner, pool, rows)

    def serve(overlap):
        pool = KVPool(pc.runner.spec, pc.device, 2048, 16)
        sched = ServingScheduler(pc.runner, pool, token_budget=64, planner=pc.core.planner, forward=forward,
                                 chains=pc.engine().prefix)
        sched.overlap = overlap
        reqs = [Request(tokens(ids), SamplingParams(max_new_tokens=40, ignore_eos=True, **GREEDY), pc.tokenizer)
                for ids in ([5, 9, 12, 40, 41, 7, 8, 9, 10, 11], [6, 7, 8])]
        for r in reqs:
            sched.add(r)
        while sched.has_work:
            sched.step()
        # a request over the first one's prompt and answer reuses every block it shared
        again = Request(tokens(list(reqs[0].kv.plan.new_ids) + reqs[0].token_ids[:-1]),
                        SamplingParams(max_new_tokens=2, **GREEDY), pc.tokenizer)
        sched.add(again)
        while sched.has_work:
            sched.step()
        keys = sorted(e["key"] for e in pool.describe()["entries"])
        return reqs, again, sched, keys

    plain, overlapped = serve(False), serve(True)
    assert [r.token_ids for r in plain[0]] == [r.token_ids for r in overlapped[0]]
    assert plain[3] == overlapped[3] and len(plain[3]) >= 4  # the same blocks shared under the same keys
    assert overlapped[2].published_blocks == plain[2].published_blocks
    assert overlapped[1].prefill.cached_tokens == plain[1].prefill.cached_tokens >= 32
    assert overlapped[1].token_ids == plain[1].token_ids
    assert overlapped[2].ahead_steps >= 20 and AHEAD in seen  # placeholders carried, never read by a forward


def test_overlap_defaults_to_the_gpu_only(monkeypatch):
    pc = engine("llama", make_tokenizer())
    pool = KVPool(pc.runner.spec, pc.device, 256, 16)
    # "auto": on where the pool is on a GPU, off on a CPU
    assert ServingScheduler(pc.runner, pool, planner=pc.core.planner).overlap == (pool.buf.device.type == "cuda")
    monkeypatch.setattr(tunables, "OVERLAP_STEPS", True)
    assert ServingScheduler(pc.runner, pool, planner=pc.core.planner).overlap
    monkeypatch.setattr(tunables, "OVERLAP_STEPS", False)
    assert not ServingScheduler(pc.runner, pool, planner=pc.core.planner).overlap


def test_steps_launched_ahead_run_over_static_buffers_as_captured_steps_do(monkeypatch):
    """The static decode step (``CapturedSteps``, uncaptured here) copies a step's ids from the last
    argmax on the device into its buffers: launched ahead, the steps decode the plain run's tokens."""
    from promptcache.engine.serving_core.graphs import CapturedSteps

    monkeypatch.setattr(paged.cpu_attention, "gathers", lambda buf: False)
    pc = engine("llama", make_tokenizer())
    steps = CapturedSteps(pc.runner, batches=(1, 2, 4), width=8)
    specs = [(p, SamplingParams(max_new_tokens=n, ignore_eos=True, **GREEDY), None) for p, n in zip(PROMPTS, (9, 5, 9))]
    plain, overlapped = run(pc, specs, False), run(pc, specs, True, forward=steps.forward)
    steps.release()  # the pad rows' scratch block back to the pool
    assert_same(plain, overlapped)
    assert overlapped[2].ahead_steps >= 5 and steps.static_steps >= overlapped[2].ahead_steps


def test_host_tensors_reach_the_device_as_given():
    """``dense.on_device``: the step's host ints as a tensor on the pool's device (on a GPU from pinned
    memory without blocking, so a step launched ahead does not wait for the one before it)."""
    from promptcache.engine.serving_core.dense import on_device

    got = on_device([[1, 2, 3], [4, 5, 6]], torch.device("cpu"))
    assert got.dtype == torch.long and got.tolist() == [[1, 2, 3], [4, 5, 6]]
    if torch.cuda.is_available():
        dev = torch.device("cuda")
        big = torch.randn(4096, 4096, device=dev)
        for _ in range(20):  # kernels queued before the copy
            big = big @ big / 64
        moved = on_device(list(range(1000)), dev)
        assert moved.device.type == "cuda" and moved.tolist() == list(range(1000))


def test_a_request_paused_and_resumed_mid_flight_is_scheduled_again(native):
    """A request paused while the others decode ahead, then resumed: the chain of steps launched
    ahead stops for it (every running request must be in a step launched ahead), so it decodes on;
    each request's outputs are the plain run's."""
    pc = engine("llama", make_tokenizer())

    def pause(sched, reqs, index):
        reqs[1].paused = True

    seen = {}

    def resume(sched, reqs, index):
        reqs[1].paused = False
        seen["resumed"] = len(reqs[1].token_ids)

    def check(sched, reqs, index):  # two steps after its resumption it has decoded again
        seen[sched.overlap] = len(reqs[1].token_ids) - seen["resumed"]

    specs = [(p, SamplingParams(max_new_tokens=16, ignore_eos=True, **GREEDY), None) for p in PROMPTS[:3]]
    events = {4: pause, 8: resume, 11: check}
    plain, overlapped = run(pc, specs, False, dict(events)), run(pc, specs, True, dict(events))
    assert_same(plain, overlapped)
    assert seen[True] >= 1 and seen[False] >= 2, seen
    assert all(len(r.token_ids) == 16 for r in overlapped[0])
    assert overlapped[2].ahead_steps >= 6


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_requests_ending_by_length_at_other_steps_leave_the_step_launched_ahead(family, native):
    """Four requests of 3, 6, 9 and 12 tokens: a request whose next token is its last is left out
    of the step launched ahead (its rows' ids the others' argmax, gathered on the device), so every
    decode step but the last is launched ahead; the tokens are the plain run's."""
    pc = engine(family, make_tokenizer())
    specs = [(PROMPTS[i % 3], SamplingParams(max_new_tokens=n, ignore_eos=True, **GREEDY), None)
             for i, n in enumerate((3, 6, 9, 12))]
    plain, overlapped = run(pc, specs, False), run(pc, specs, True)
    assert_same(plain, overlapped)
    assert [len(r.token_ids) for r in overlapped[0]] == [3, 6, 9, 12]
    # 11 decode steps after the prefill steps; breaking the chain at each request's last token
    # (3, 6, 9) would launch at most 7 of them ahead
    assert overlapped[2].ahead_steps >= 9
