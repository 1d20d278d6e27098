"""Static decode steps compiled whole (``CapturedSteps(compile=True)``; ``RunnerConfig(compile=True,
cuda_graphs=True)``): the forward over a bucket's buffers traced by torch.compile with its attention
inside the graph (``graphs.static_attention``: the pool write, the gather, the rotation of shifted
keys and the fused attention as plain tensor calls inductor fuses), not the eager ``attend_dense``.

On a CPU the compiled step runs as it is (a GPU captures its kernels as one CUDA graph): every step's
float32 logits within 1e-4 of the eager dense path (the native CPU kernel off, as on a GPU), the
oracle's greedy tokens; documents read shifted (rotary over every channel and over a quarter of
them), a bfloat16 pool. Each test compiles (seconds a graph on this CPU).
"""

from __future__ import annotations

import pytest
import torch

from promptcache import EngineConfig, PromptCache, RunnerConfig
from promptcache.engine.serving_core import paged
from promptcache.engine.serving_core.graphs import CapturedSteps
from test_captured_graphs import BATCHES, RAG_NEW, WIDTH, assert_same_steps, pml_batch_through, pml_specs, rag_case, serve
from tiny import make_model, make_tokenizer
from trip import SCHEMA

pytestmark = pytest.mark.slow  # compiling: ~10-20 s a graph on a CPU


@pytest.fixture
def dense(monkeypatch):
    """The path a GPU takes: no native CPU kernel (as test_captured_graphs' fixture)."""
    from promptcache.kernels import attention as cpu_attention

    monkeypatch.setattr(cpu_attention, "gathers", lambda buf: False)


def decode_attention_calls(monkeypatch) -> list[int]:
    """Counts the eager dense attention's calls over steps of one query a row (decode steps): a
    compiled static step makes none (prefill steps, through the other forward, still call it)."""
    calls = []

    def counted(step, *args, **kwargs):
        if step.queries == 1:
            calls.append(step.rows)
        return ATTEND_DENSE(step, *args, **kwargs)

    monkeypatch.setattr(paged, "attend_dense", counted)
    return calls


ATTEND_DENSE = paged.attend_dense


def test_compiled_static_steps_equal_the_eager_dense_path_and_the_oracle(dense):
    """Three requests decoding together (padded to 4), one finishing early (then 2 rows), keys crossing
    widths: one compiled graph for every bucket of 2 rows or more (symbolic sizes), the logits of
    every step as the eager dense path's, the oracle's greedy tokens."""
    steps, sched = pml_batch_through(lambda runner: CapturedSteps(runner, batches=BATCHES, width=WIDTH, compile=True))
    assert steps.compiled and steps.static_steps >= 10
    assert len({key[:2] for key in steps.buckets}) >= 3  # several (rows, width) buckets ...
    assert (2, None) in steps.compile_seconds  # ... one graph for every bucket of 2 rows or more
    assert len(steps.compile_seconds) <= 2  # and one for 1 row, if a step had one
    pool = sched.pool
    assert pool.free_blocks == pool.num_blocks - 1  # the pad rows' scratch block only


@pytest.mark.parametrize("family,kv_dtype", [("llama", "bfloat16"), ("gpt_neox", None)])
def test_compiled_static_steps_read_documents_shifted_as_the_eager_dense_path(family, kv_dtype, dense, monkeypatch):
    """Five questions over documents in other orders (each document read at several shifts): the
    compiled graph rotates the shifted keys as the eager path does (rotary over every channel with a
    bfloat16 pool; over a quarter of the channels), and its decode steps never call the eager
    attention, which the uncompiled static steps do."""
    pc, specs = rag_case(family, kv_dtype)
    max_new = RAG_NEW
    want, want_logits, _ = serve(pc, specs(), max_new, budget=512)
    calls = decode_attention_calls(monkeypatch)
    eager = CapturedSteps(pc.runner, batches=BATCHES, width=WIDTH)
    serve(pc, specs(), max_new, forward=eager.forward, budget=512)
    assert len(calls) >= eager.static_steps * pc.runner.spec.layers > 0  # uncompiled: the eager attention
    calls.clear()
    steps = CapturedSteps(pc.runner, batches=BATCHES, width=WIDTH, compile=True)
    got, got_logits, _ = serve(pc, specs(), max_new, forward=steps.forward, budget=512)
    assert calls == []
    assert_same_steps(got_logits, want_logits)
    assert [r.token_ids for r in got] == [r.token_ids for r in want]
    assert steps.static_steps >= 4 and steps.fallback_steps >= 1
    assert all(key[2] is not None for key in steps.buckets)  # every step rotated shifted documents
    assert all(rotation is not None for _, rotation in steps.compile_seconds)


def test_the_engine_asked_for_compiled_cuda_graphs_decodes_as_without_them(dense):
    """``RunnerConfig(compile=True, cuda_graphs=True)``: the engine's decode steps run the static step
    compiled whole (prefill steps the compiled paged forward) and ``generate`` gives the tokens of an
    engine with neither."""
    tok = make_tokenizer()
    prompts = [[5, 9, 12, 40, 41, 7], [5, 9, 13], [8, 8, 20, 21]]
    outs = []
    for on in (False, True):
        pc = PromptCache(make_model("llama"), tok, EngineConfig(runner=RunnerConfig(compile=on, cuda_graphs=on)))
        outs.append([r.token_ids for r in pc.generate(prompts, max_new_tokens=8, temperature=0.0)])
        captured = pc.engine().captured
        if on:
            assert captured.compiled and captured.static_steps >= 6 and captured.compile_seconds
    assert outs[0] == outs[1]


def test_a_model_whose_attention_is_inline_is_never_compiled_as_a_static_step():
    """ALiBi families compute attention inline: no static step, nothing compiled."""
    pc = PromptCache(make_model("bloom"), make_tokenizer())
    steps = CapturedSteps(pc.runner, compile=True)
    assert steps.never is not None and not steps.compiled


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_compiled_static_steps_captured_replay_the_uncaptured_ones_on_the_gpu():
    """On a GPU: the compiled static step of each bucket is captured once (after the run that
    compiles it) and replayed; every step's float32 logits as the same compiled steps uncaptured,
    the same tokens, and every step launched ahead (the overlap, on by default there) reads them."""
    from promptcache.models.loading import load_model

    model, tok = load_model("embedded", device="cuda", dtype="float32")
    pc = PromptCache(model, tok)
    pc.add_schema(SCHEMA)
    runs = []
    for capture in (False, True):
        steps = CapturedSteps(pc.runner, batches=BATCHES, width=WIDTH, compile=True)
        steps.capture = capture
        reqs, logits, sched = serve(pc, pml_specs(pc), [12, 3, 12], forward=steps.forward)
        runs.append((reqs, logits, steps, sched))
    (plain, plain_logits, uncaptured, _), (got, got_logits, steps, sched) = runs
    assert steps.capture_error is None, steps.capture_error
    assert uncaptured.replayed == 0 and steps.replayed == steps.static_steps > 0
    assert len(steps.capture_seconds) == len(steps.buckets)
    assert_same_steps(got_logits, plain_logits)
    assert [r.token_ids for r in got] == [r.token_ids for r in plain]
    assert sched.overlap and sched.ahead_steps > 0
