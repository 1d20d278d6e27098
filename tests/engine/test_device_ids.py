"""Sampled ids kept on the device between decode steps (``PagedRow.sampled``, ``ServingScheduler``).

A step whose rows are exactly the last step's requests, each of which took its row's argmax, takes
its input ids from the last step's argmax tensor as it is (no ids copied in from the host); any
other step builds them from the host's ids. The served tokens must be the oracle's either way,
with the native kernel and without it (the path a GPU takes), across a batch whose membership
changes (a request finishing early, one sampling), and the ids a step reads must be the host's.
"""

from __future__ import annotations

import pytest
import torch

from promptcache.engine.decoding.sampling import SamplingParams
from promptcache.engine.serving_core import paged
from promptcache.engine.serving_core.kvpool import KVPool
from promptcache.engine.serving_core.request import Request
from promptcache.engine.serving_core.scheduler import ServingScheduler
from promptcache.models.splice import KVSpec


def test_step_inputs_take_the_kept_ids_only_for_exactly_their_rows():
    pool = KVPool(KVSpec(layers=1, kv_heads=1, head_dim=16, dtype=torch.float32), torch.device("cpu"), 256, 4)
    kept = torch.tensor([7, 9, 11])
    rows = [paged.PagedRow([t], [5], [], pool.slots(pool.allocate(2), 0, 6), sampled=kept) for t in (7, 9, 11)]
    ids = paged.step_inputs(pool, rows)[0]
    assert ids.tolist() == [[7, 9, 11]] and ids.data_ptr() == kept.data_ptr()  # the tensor itself
    fewer = paged.step_inputs(pool, rows[:2])[0]  # not the rows that sampled them: the host's ids
    assert fewer.tolist() == [[7, 9]] and fewer.data_ptr() != kept.data_ptr()
    extra = rows + [paged.PagedRow([4, 5], [0, 1], [], pool.slots(pool.allocate(1), 0, 2))]
    assert paged.step_inputs(pool, extra)[0].tolist() == [[7, 9, 11, 4, 5]]


@pytest.mark.parametrize("native", [True, False])
@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_served_tokens_with_device_ids_equal_the_oracle(family, native, monkeypatch):
    """Requests decoding together for 10 tokens, one stopping after 4 and one sampling (a seeded
    temperature): the greedy ones decode the oracle's tokens, and most steps read their ids from
    the device (none while the sampling request runs beside them)."""
    from oracle import definition_greedy
    from test_serving import engine, pml
    from tiny import make_tokenizer
    from trip import PROMPTS

    if not native:
        monkeypatch.setattr(paged.cpu_attention, "gathers", lambda buf: False)
    read = []
    inputs = paged.step_inputs

    def recorded(pool, rows):
        out = inputs(pool, rows)
        assert out[0][0].tolist() == [t for r in rows for t in r.ids]  # the host's ids, wherever they come from
        read.append(rows[0].sampled is not None and out[0].data_ptr() == rows[0].sampled.data_ptr())
        return out

    monkeypatch.setattr(paged, "step_inputs", recorded)
    pc = engine(family, make_tokenizer())
    schema = pc.schema("trip").layout
    sched = ServingScheduler(pc.runner, KVPool(pc.runner.spec, pc.device, 1024, 16), token_budget=64,
                             planner=pc.core.planner)
    sched.overlap = False  # every step's host ids are the tokens read back (a step launched ahead: test_overlap.py)
    greedy = [Request(pml(pc, p), SamplingParams(max_new_tokens=n, temperature=0.0), pc.tokenizer)
              for p, n in zip(PROMPTS, (10, 4, 10))]
    for r in greedy:
        sched.add(r)
    while sched.has_work:
        sched.step()
    for prompt, req in zip(PROMPTS, greedy):
        want = definition_greedy(pc.model, schema, pc.layout(prompt), len(req.token_ids), eos=3)
        assert req.error is None and req.token_ids == want, prompt
    assert sched.device_id_steps >= 5 and sum(read) == sched.device_id_steps
    # beside a request that samples, no step's ids come from the device
    sampling = Request(pml(pc, PROMPTS[0]), SamplingParams(max_new_tokens=8, temperature=1.0, seed=3), pc.tokenizer)
    plain = Request(pml(pc, PROMPTS[1]), SamplingParams(max_new_tokens=8, temperature=0.0), pc.tokenizer)
    before = sched.device_id_steps
    for r in (sampling, plain):
        sched.add(r)
    while sched.has_work:
        sched.step()
    assert sched.device_id_steps == before and plain.error is None and sampling.error is None
    want = definition_greedy(pc.model, schema, pc.layout(PROMPTS[1]), len(plain.token_ids), eos=3)
    assert plain.token_ids == want
