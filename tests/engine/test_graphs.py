"""Compiled serving steps (``engine/serving_core/graphs.py``): bucketing, and compiled steps equal to eager ones.

Exactness: every family the pool serves gets, through compiled steps, the logits (within 1e-4)
and greedy tokens of the eager paged steps, for PML prompts with gaps, unions and parameters
served together (decode rows batched, short prefill chunks, a step larger than every bucket run
eagerly). Compiling takes seconds per family on 2 cores: the family sweep is marked slow.
"""

from __future__ import annotations

import pytest
import torch

from promptcache import PromptCache
from promptcache.engine.serving_core.graphs import CompiledSteps, bucket_for, compile_refusal
from promptcache.engine.serving_core.kvpool import KVPool
from promptcache.engine.serving_core.request import Request
from promptcache.engine.decoding.sampling import SamplingParams
from promptcache.engine.serving_core.scheduler import ServingScheduler
from promptcache.engine import PmlPrompt
from promptcache.errors import ConfigError
from promptcache.pml import parse_prompt
from tiny import fresh_model, make_model, make_tokenizer, packed_refused
from trip import POOLED, PROMPTS, SCHEMA

TOL = 1e-4
@pytest.fixture(scope="module")
def tokenizer():
    return make_tokenizer()


def serve(pc, forward, budget: int, max_new: int = 6) -> tuple[list[Request], ServingScheduler]:
    pool = KVPool(pc.runner.spec, pc.device, 1024, 16)
    sched = ServingScheduler(pc.runner, pool, token_budget=budget, forward=forward, planner=pc.core.planner)
    reqs = []
    for p in PROMPTS:
        reqs.append(Request(PmlPrompt(parse_prompt(p), recompute=0),
                            SamplingParams(max_new_tokens=max_new, temperature=0.0), pc.tokenizer))
        sched.add(reqs[-1])
    while sched.has_work:
        sched.step()
    return reqs, sched


def test_a_step_runs_as_the_smallest_bucket_that_holds_it():
    assert [bucket_for(n, (1, 2, 4, 8)) for n in (1, 2, 3, 4, 5, 8, 9)] == [1, 2, 4, 4, 8, 8, None]


def test_bad_buckets_and_models_the_pool_cannot_serve_are_refused(tokenizer, monkeypatch):
    pc = PromptCache(make_model("llama"), tokenizer)
    with pytest.raises(ConfigError, match="increasing"):
        CompiledSteps(pc.runner, buckets=(4, 2))
    from promptcache.models import families  # an ALiBi term off by 1%: the paged self-check fails
    right = families.Bloom.paged_bias
    monkeypatch.setattr(families.Bloom, "paged_bias", lambda self, positions: right(self, positions) * 1.01)
    bloom = PromptCache(make_model("bloom"), tokenizer)
    assert "self-check" in compile_refusal(bloom.runner)
    with pytest.raises(ConfigError, match="RunnerConfig.compile"):
        CompiledSteps(bloom.runner)


def check_family(family, tokenizer, budget=12, pad=False):
    pc = PromptCache(make_model(family), tokenizer)
    pc.add_schema(SCHEMA)
    want, _ = serve(pc, None, budget)
    steps = CompiledSteps(pc.runner, buckets=(1, 2, 4, 8), pad=pad)
    got, sched = serve(pc, steps.forward, budget)
    for prompt, a, b in zip(PROMPTS, want, got):
        assert a.error is None and b.error is None, (family, prompt, b.error)
        assert torch.max(torch.abs(a.prefill.logits - b.prefill.logits)).item() <= TOL, (family, prompt)
        assert a.token_ids == b.token_ids, (family, prompt)
    assert steps.compiled_steps > 0 and steps.eager_steps > 0  # chunks of 12 tokens pass the last bucket (8)
    if pad:
        assert set(steps.compile_seconds) <= {(n, r) for n in (1, 2, 4, 8) for r in (1, 2, 4, 8)}
    else:  # symbolic sizes: one graph for one token, one for more with one logits row, one for more rows
        assert set(steps.compile_seconds) <= {(1, 1), (2, 1), (2, 2)}
    assert sched.pool.free_blocks == sched.pool.num_blocks  # pad tokens wrote nowhere they keep
    return steps


def test_compiled_steps_equal_eager_steps_llama(tokenizer):
    steps = check_family("llama", tokenizer)
    assert not steps.pad  # CPU: symbolic sizes, steps unpadded
    assert (2, 2) in steps.compile_seconds  # decode rows batched


def test_padded_compiled_steps_equal_eager_steps_llama(tokenizer):
    """Bucketing, as CUDA graphs use it: pad tokens attend to nothing and are written nowhere."""
    steps = check_family("llama", tokenizer, pad=True)
    assert (1, 1) in steps.compile_seconds or (2, 2) in steps.compile_seconds or (4, 4) in steps.compile_seconds


def test_warm_compiles_every_graph_of_unpadded_steps_and_serving_needs_no_other(tokenizer):
    pc = PromptCache(make_model("llama"), tokenizer)
    pc.add_schema(SCHEMA)
    steps = CompiledSteps(pc.runner, buckets=(1, 2, 4, 8), pad=False)  # unpadded (a GPU pads by default)
    steps.warm()
    assert set(steps.compile_seconds) == {(1, 1), (2, 1), (2, 2)}
    serve(pc, steps.forward, 12)
    assert set(steps.compile_seconds) == {(1, 1), (2, 1), (2, 2)} and steps.compiled_steps > 3


@pytest.mark.slow
@pytest.mark.parametrize("pad", [False, True])
def test_compiled_steps_on_the_dense_path_equal_eager_steps(pad, tokenizer, monkeypatch):
    """Without the native kernel (the path a GPU takes) the attention op of every layer runs
    dense.py's one padded call (keys and values written in one copy, stacked in the graph): the
    same logits and tokens as the eager steps, themselves held to the oracle (test_serving.py)."""
    from promptcache.engine.serving_core import paged

    monkeypatch.setattr(paged.cpu_attention, "gathers", lambda buf: False)
    calls = []
    real = paged.attend_dense
    monkeypatch.setattr(paged, "attend_dense", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    pc = PromptCache(make_model("llama"), tokenizer)
    pc.add_schema(SCHEMA)
    want, _ = serve(pc, None, 12)
    eager_calls = len(calls)
    steps = CompiledSteps(pc.runner, buckets=(1, 2, 4, 8), pad=pad)
    got, sched = serve(pc, steps.forward, 12)
    assert eager_calls > 0 and len(calls) - eager_calls >= steps.compiled_steps * pc.runner.spec.layers
    for prompt, a, b in zip(PROMPTS, want, got):
        assert a.error is None and b.error is None, (prompt, b.error)
        assert torch.max(torch.abs(a.prefill.logits - b.prefill.logits)).item() <= TOL, prompt
        assert a.token_ids == b.token_ids, prompt
    assert steps.compiled_steps > 0 and sched.pool.free_blocks == sched.pool.num_blocks


@pytest.mark.slow
@pytest.mark.parametrize("family", [f for f in POOLED if f != "llama"])
def test_compiled_steps_equal_eager_steps(family, tokenizer):
    check_family(family, tokenizer)


def test_two_models_of_one_class_get_graphs_of_their_own(tokenizer):
    """The modules are not guarded, so a graph must never pass from one model to another of the
    same class: a bfloat16 model compiled after a float32 one (its graph has float32 weights
    baked into its kernels' types) runs graphs of its own and agrees with its eager steps
    within bfloat16's rounding (the rule of the test below)."""
    first = PromptCache(make_model("llama"), tokenizer)
    first.add_schema(SCHEMA)
    serve(first, CompiledSteps(first.runner, buckets=(1, 2, 4, 8)).forward, 12)
    second = PromptCache(fresh_model("llama").to(torch.bfloat16), tokenizer)
    second.add_schema(SCHEMA)
    want, _ = serve(second, None, 12)
    steps = CompiledSteps(second.runner, buckets=(1, 2, 4, 8))
    got, _ = serve(second, steps.forward, 12)
    assert steps.compiled_steps > 0
    for prompt, a, b in zip(PROMPTS, want, got):
        assert a.error is None and b.error is None, (prompt, b.error)
        assert torch.max(torch.abs(a.prefill.logits.float() - b.prefill.logits.float())).item() <= 0.4, prompt


@pytest.mark.slow
def test_bfloat16_compiled_steps_stay_as_close_to_the_float32_oracle_as_eager_ones(tokenizer):
    """bfloat16 (docs/DESIGN.md section 4): compiled and eager steps round differently, so they are
    held to the float32 run of the same weights: the compiled one within 1.5x the eager one's
    distance + 0.05, both within 0.4 (logits of magnitude ~5; a wrong position or mask is off by
    whole units). Chunks of 8 prefill tokens: every step runs compiled."""
    from trip import serve_together

    ref_pc = PromptCache(make_model("llama"), tokenizer)
    ref_pc.add_schema(SCHEMA)
    ref = serve_together(ref_pc, PROMPTS, budget=8)
    pc = PromptCache(fresh_model("llama").to(torch.bfloat16), tokenizer)
    pc.add_schema(SCHEMA)
    eager = serve_together(pc, PROMPTS, budget=8)
    steps = CompiledSteps(pc.runner, buckets=(1, 2, 4, 8, 16, 32))
    compiled = serve_together(pc, PROMPTS, budget=8, forward=steps.forward)
    assert steps.compiled_steps > 0 and steps.eager_steps == 0
    for prompt, r, e, c in zip(PROMPTS, ref, eager, compiled):
        err_e = torch.max(torch.abs(e.prefill.logits.float() - r.prefill.logits)).item()
        err_c = torch.max(torch.abs(c.prefill.logits.float() - r.prefill.logits)).item()
        assert err_e <= 0.4 and err_c <= 0.4 and err_c <= 1.5 * err_e + 0.05, (prompt, err_e, err_c)


@pytest.mark.cpu_only(refusal=packed_refused)
def test_compiled_steps_of_a_packed_model_equal_its_eager_steps(tokenizer):
    """Packed linears (q/k/v and gate/up one product each) inside the compiled graph."""
    from promptcache import EngineConfig, RunnerConfig

    pc = PromptCache(fresh_model("llama"), tokenizer, EngineConfig(runner=RunnerConfig(packed_linear=True)))
    pc.add_schema(SCHEMA)
    want, _ = serve(pc, None, 12)
    steps = CompiledSteps(pc.runner, buckets=(1, 2, 4, 8))
    got, _ = serve(pc, steps.forward, 12)
    for a, b in zip(want, got):
        assert torch.max(torch.abs(a.prefill.logits - b.prefill.logits)).item() <= TOL
        assert a.token_ids == b.token_ids
    assert steps.compiled_steps > 0


def test_the_cuda_options_are_ones_torch_compile_takes_and_the_attention_op_is_kept_out_of_cuda_graphs():
    """The CUDA path cannot run here; what can be checked on a CPU is checked: torch.compile
    validates option names when it is called (an unknown one raises), and the attention op
    carries the tag inductor's graph partition reads."""
    from promptcache.engine.serving_core.graphs import compile_options

    cpu = compile_options(torch.device("cpu"))
    assert "triton.cudagraphs" not in cpu
    torch.compile(torch.nn.Linear(2, 2), options=cpu)
    options = compile_options(torch.device("cuda"))
    assert options["triton.cudagraphs"] and options["graph_partition"]
    torch.compile(torch.nn.Linear(2, 2), options=options)  # raises on an option name torch does not know
    tag = getattr(torch.Tag, "cudagraph_unsafe", None)
    if tag is not None:
        assert tag in torch.ops.promptcache.paged_attention.default.tags
