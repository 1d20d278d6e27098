"""Decode steps over persistent buffers (``serving_core/graphs.py``: ``CapturedSteps``, ``RunnerConfig.cuda_graphs``).

On a CPU the static step runs uncaptured, the same buffers and calls a GPU captures and replays: a
served decode through it must give, step by step, the float32 logits (within 1e-4) and greedy
tokens of the eager dense path (the native CPU kernel off, as on a GPU), and the oracle's tokens:
rows padded up to a bucket, rows whose keys grow past a bucket's width (the step moves to another
bucket), a request finishing while the others decode, documents read shifted (a RAG batch's
documents in the pool), a bfloat16 pool. What a static step cannot express runs the other forward,
with a debug line. With ``PROMPTCACHE_TEST_DEVICE=cuda`` the same tests capture and replay CUDA
graphs; the tests marked for CUDA check the capture itself (skipped without a GPU).
"""

from __future__ import annotations

import logging

import pytest
import torch

from promptcache import EngineConfig, PromptCache, RunnerConfig
from promptcache.engine import TokenPrompt
from promptcache.engine.decoding.sampling import SamplingParams
from promptcache.engine.serving_core import paged
from promptcache.engine.serving_core.graphs import CapturedSteps
from promptcache.engine.serving_core.kvpool import KVPool
from promptcache.engine.serving_core.request import Request
from promptcache.engine.serving_core.scheduler import ServingScheduler
from promptcache.kernels import attention as cpu_attention
from promptcache.rag import DocumentStore
from tiny import make_model, make_tokenizer
from trip import PROMPTS, SCHEMA

TOL = 1e-4
BATCHES = (1, 2, 4, 8)  # 3 or 5 decoding rows: padded up to 4 or 8
WIDTH = 8  # keys a row padded to a multiple of 8: decode rows cross widths every few steps


@pytest.fixture
def dense(monkeypatch):
    """The path a GPU takes: no native CPU kernel, every step's attention one dense call a layer."""
    monkeypatch.setattr(cpu_attention, "gathers", lambda buf: False)


def serve(pc, specs, max_new, forward=None, budget=24, pool_tokens=2048):
    """``specs`` (prompt specs) served together; (requests, the logits of every step, scheduler)."""
    logits = []
    inner = forward or (lambda pool, rows: paged.paged_forward(pc.runner, pool, rows))

    def recorded(pool, rows):
        out = inner(pool, rows)
        logits.append(out.float().clone())
        return out

    pool = KVPool(pc.runner.spec, pc.device, pool_tokens, 16)
    sched = ServingScheduler(pc.runner, pool, token_budget=budget, planner=pc.core.planner, forward=recorded)
    reqs = []
    for spec, n in zip(specs, max_new):
        reqs.append(Request(spec, SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True), pc.tokenizer))
        sched.add(reqs[-1])
    while sched.has_work:
        sched.step()
    assert all(r.error is None for r in reqs), [r.error for r in reqs]
    return reqs, logits, sched


def assert_same_steps(got, want):
    assert len(got) == len(want)
    for i, (a, b) in enumerate(zip(got, want)):
        assert a.shape == b.shape, i
        assert a.numel() == 0 or (a - b).abs().max().item() <= TOL, (i, (a - b).abs().max().item())


def pml_specs(pc):
    from promptcache.engine import PmlPrompt
    from promptcache.pml import parse_prompt

    return [PmlPrompt(parse_prompt(p), recompute=0) for p in PROMPTS[:3]]


def pml_batch_through(make_steps):
    """The trip batch (three PML prompts, 12, 3 and 12 tokens) served through the static steps
    ``make_steps(runner)`` makes: every step's logits as the eager dense path's and every request's
    tokens the oracle's; (the steps, the scheduler)."""
    from oracle import definition_greedy

    pc = PromptCache(make_model("llama"), make_tokenizer())
    pc.add_schema(SCHEMA)
    max_new = [12, 3, 12]
    want, want_logits, _ = serve(pc, pml_specs(pc), max_new)
    steps = make_steps(pc.runner)
    got, got_logits, sched = serve(pc, pml_specs(pc), max_new, forward=steps.forward)
    assert_same_steps(got_logits, want_logits)
    schema = pc.schema("trip").layout
    for prompt, a, b, n in zip(PROMPTS, want, got, max_new):
        assert a.token_ids == b.token_ids, prompt
        assert b.token_ids == definition_greedy(pc.model, schema, pc.layout(prompt), n), prompt
    return steps, sched


def test_served_pml_batch_through_static_steps_equals_the_eager_dense_path_and_the_oracle(dense):
    """Three requests decoding together (padded to a bucket of 4), one finishing after 3 tokens
    (then 2 rows: another bucket), keys crossing several widths of 8: every step's logits as the
    eager dense path's, the oracle's greedy tokens, the scratch block the only one held."""
    steps, sched = pml_batch_through(lambda runner: CapturedSteps(runner, batches=BATCHES, width=WIDTH))
    assert steps.static_steps >= 10 and steps.fallback_steps >= 1  # the prefill steps ran the other forward
    rows = {key[0] for key in steps.buckets}
    widths = {key[1] for key in steps.buckets}
    assert 4 in rows and 2 in rows  # 3 rows padded to 4; after one finished, 2
    assert len(widths) >= 2 and all(w % WIDTH == 0 for w in widths)  # re-bucketed as the keys grew
    assert steps.capture_error is None, steps.capture_error
    assert steps.replayed == (steps.static_steps if steps.capture else 0)
    assert sched.device_id_steps > 0  # ids from the last argmax, on the device, into the ids buffer
    pool = sched.pool
    assert pool.free_blocks == pool.num_blocks - 1  # the pad rows' scratch block
    steps.release()
    assert pool.free_blocks == pool.num_blocks


def rag(pc) -> DocumentStore:
    store = DocumentStore(pc, independent=True)
    store.add("paris", "Paris is the capital of France, famous for museums and cafes.")
    store.add("tokyo", "Tokyo is a huge city in Japan with temples, food markets and fast trains.")
    store.add("rome", "Rome is an old city with a famous tower and quiet gardens.")
    return store


ORDERS = [["paris", "tokyo", "rome"], ["rome", "paris", "tokyo"], ["tokyo", "rome"], ["rome"], ["paris", "rome"]]
RAG_NEW = [6, 6, 2, 6, 6]  # tokens each question generates (one finishes early)


def rag_case(family, kv_dtype):
    """A ``family`` model (its pool in ``kv_dtype``) over the three documents, and a function giving
    the five questions' prompt specs afresh (each read in ``ORDERS``' order, at recompute 0)."""
    torch.manual_seed(0)
    pc = PromptCache(make_model(family), make_tokenizer(), EngineConfig(runner=RunnerConfig(kv_dtype=kv_dtype)))
    store = rag(pc)
    return pc, lambda: [store.prompt(f"Which city is old? ({i})", ids, recompute=0.0) for i, ids in enumerate(ORDERS)]


@pytest.mark.parametrize("family,kv_dtype", [("llama", None), ("llama", "bfloat16"), ("gpt_neox", None)])
def test_rag_rows_reading_documents_shifted_through_static_steps_equal_the_eager_dense_path(family, kv_dtype, dense):
    """Five questions over documents in other orders (each document read at several shifts, copied
    into the pool), padded to a bucket of 8: the keys' rotation is copied into the bucket's buffers
    (rotary over every channel, over a quarter of them; a bfloat16 pool)."""
    pc, specs = rag_case(family, kv_dtype)
    max_new = RAG_NEW
    want, want_logits, _ = serve(pc, specs(), max_new, budget=512)
    steps = CapturedSteps(pc.runner, batches=BATCHES, width=WIDTH)
    got, got_logits, _ = serve(pc, specs(), max_new, forward=steps.forward, budget=512)
    assert_same_steps(got_logits, want_logits)
    assert [r.token_ids for r in got] == [r.token_ids for r in want]
    assert steps.static_steps >= 4
    assert any(key[0] == 8 for key in steps.buckets)  # 5 rows padded to 8
    assert all(key[2] is not None for key in steps.buckets)  # every step rotated shifted documents
    if family == "gpt_neox":  # rotary over a quarter of the channels: the bucket rotates only those
        assert all(key[2][0] < pc.runner.spec.head_dim for key in steps.buckets)


def test_steps_a_static_step_cannot_express_run_the_other_forward_with_a_debug_line(dense, caplog, monkeypatch):
    """More rows than the largest bucket, prefill rows, a model with ALiBi, the native kernel's path:
    each step goes to ``fallback`` (here recording), logged with its reason, and the answer stands."""
    pc = PromptCache(make_model("llama"), make_tokenizer())
    pc.add_schema(SCHEMA)
    calls = []

    def fallback(pool, rows):
        calls.append(len(rows))
        return paged.paged_forward(pc.runner, pool, rows)

    steps = CapturedSteps(pc.runner, fallback=fallback, batches=(1, 2), width=WIDTH)
    want, want_logits, _ = serve(pc, pml_specs(pc), [4, 4, 4])
    with caplog.at_level(logging.DEBUG, logger="promptcache.engine.serving_core.graphs"):
        got, got_logits, _ = serve(pc, pml_specs(pc), [4, 4, 4], forward=steps.forward)
    assert_same_steps(got_logits, want_logits)
    # three decode rows: more than the largest bucket (2); the last ones, fewer, ran static
    assert calls.count(3) >= 2 and steps.static_steps >= 1 and steps.fallback_steps == len(calls)
    assert "more than the largest bucket" in caplog.text and "a prefill row" in caplog.text
    bloom = PromptCache(make_model("bloom"), make_tokenizer())
    assert CapturedSteps(bloom.runner).never is not None
    rows = [paged.PagedRow([1], [0], [], torch.tensor([0]))]
    assert "ALiBi" in CapturedSteps(bloom.runner).refusal(KVPool(bloom.runner.spec, bloom.device, 64, 16), rows)
    monkeypatch.setattr(cpu_attention, "gathers", lambda buf: True)
    assert "native CPU kernel" in steps.refusal(KVPool(pc.runner.spec, pc.device, 64, 16), rows)


@pytest.mark.parametrize("window", [7, 200])
def test_sliding_windows_run_static_steps_until_a_row_reaches_past_them(window, dense, caplog):
    """Gemma 3 (sliding layers): while no row's keys reach past the window the plan reads no key
    positions and the step is static; a window of 7 is passed at once, and those steps run the other
    forward (logged). Either way the eager path's logits and tokens. (Token prompts: a PML prompt's
    modules stay in the store's tensors for a windowed model, outside the pool.)"""
    from tiny import gemma3_model

    pc = PromptCache(gemma3_model(window), make_tokenizer())
    prompts = ((5, 9, 12, 40, 41, 7, 8, 30, 31), (5, 9, 13), (8, 8, 20))
    specs = lambda: [TokenPrompt(ids, "ns") for ids in prompts]  # noqa: E731
    want, want_logits, _ = serve(pc, specs(), [6, 6, 6])
    steps = CapturedSteps(pc.runner, batches=BATCHES, width=WIDTH)
    with caplog.at_level(logging.DEBUG, logger="promptcache.engine.serving_core.graphs"):
        got, got_logits, _ = serve(pc, specs(), [6, 6, 6], forward=steps.forward)
    assert_same_steps(got_logits, want_logits)
    assert [r.token_ids for r in got] == [r.token_ids for r in want]
    if window == 7:
        assert steps.static_steps == 0 and "a sliding window some row reaches past" in caplog.text
    else:
        assert steps.static_steps >= 4


def test_documents_read_from_the_store_in_place_run_the_other_forward(dense, caplog, monkeypatch):
    """With documents left in the store's tensors (``tunables.POOL_DOCUMENTS`` off) a decode step
    merges segments from outside the pool: the other forward, logged, the same answer."""
    from promptcache import tunables

    monkeypatch.setattr(tunables, "POOL_DOCUMENTS", False)
    pc = PromptCache(make_model("llama"), make_tokenizer())
    store = rag(pc)
    specs = lambda: [store.prompt(f"Which city is old? ({i})", ids, recompute=0.0)  # noqa: E731
                     for i, ids in enumerate(ORDERS[:3])]
    want, want_logits, _ = serve(pc, specs(), [4, 4, 4], budget=512)
    steps = CapturedSteps(pc.runner, batches=BATCHES, width=WIDTH)
    with caplog.at_level(logging.DEBUG, logger="promptcache.engine.serving_core.graphs"):
        got, got_logits, _ = serve(pc, specs(), [4, 4, 4], forward=steps.forward, budget=512)
    assert_same_steps(got_logits, want_logits)
    assert steps.static_steps == 0 and "segments held outside the pool" in caplog.text


def test_the_engine_asked_for_cuda_graphs_decodes_as_without_them(dense):
    """``RunnerConfig(cuda_graphs=True)``: the engine's decode steps go through the static step
    (uncaptured on a CPU), prefill through the paged forward, and ``generate`` gives the same
    tokens as an engine without it."""
    tok = make_tokenizer()
    prompts = [[5, 9, 12, 40, 41, 7], [5, 9, 13], [8, 8, 20, 21]]
    outs = []
    for graphs in (False, True):
        pc = PromptCache(make_model("llama"), tok, EngineConfig(runner=RunnerConfig(cuda_graphs=graphs)))
        outs.append([r.token_ids for r in pc.generate(prompts, max_new_tokens=8, temperature=0.0)])
        captured = pc.engine().captured
        assert (captured is not None) == graphs
        if graphs:
            assert captured.static_steps >= 6 and captured.fallback_steps >= 1
    assert outs[0] == outs[1]


def test_a_capture_that_fails_is_logged_and_the_static_steps_run_uncaptured(dense, caplog):
    """A GPU whose capture refuses an operation: a warning naming the error, and every step still
    the eager dense path's (here a CPU told it captures, whose capture raises as CUDA's would)."""
    pc = PromptCache(make_model("llama"), make_tokenizer())
    pc.add_schema(SCHEMA)
    want, want_logits, _ = serve(pc, pml_specs(pc), [6, 6, 6])
    steps = CapturedSteps(pc.runner, batches=BATCHES, width=WIDTH)
    steps.capture = True

    def refused(bucket):
        raise RuntimeError("operation not permitted when stream is capturing")

    steps._capture = refused
    with caplog.at_level(logging.WARNING, logger="promptcache.engine.serving_core.graphs"):
        got, got_logits, _ = serve(pc, pml_specs(pc), [6, 6, 6], forward=steps.forward)
    assert_same_steps(got_logits, want_logits)
    assert [r.token_ids for r in got] == [r.token_ids for r in want]
    assert not steps.capture and "not permitted" in steps.capture_error and steps.replayed == 0
    assert steps.static_steps >= 4 and "run uncaptured" in caplog.text


def test_a_bucket_whose_rows_drop_resets_the_rows_left_to_padding(dense):
    """One bucket of 8 rows and 128 keys serves the batch from 3 rows to fewer (requests finished): the
    rows they left write to the scratch slot again and attend to it alone, every padded key stays
    masked, and the steps are the eager path's."""
    pc = PromptCache(make_model("llama"), make_tokenizer())
    pc.add_schema(SCHEMA)
    want, want_logits, _ = serve(pc, pml_specs(pc), [12, 3, 12])
    steps = CapturedSteps(pc.runner, batches=(8,), width=128)
    got, got_logits, _ = serve(pc, pml_specs(pc), [12, 3, 12], forward=steps.forward)
    assert_same_steps(got_logits, want_logits)
    (bucket,) = steps.buckets.values()
    b, w = bucket.last
    assert b < 3 and bucket.key[:2] == (8, 128)  # it began with 3 rows
    mask = bucket.dense.mask.view(8, 128)
    assert bucket.write[b:].tolist() == [steps.scratch_slot] * (8 - b)
    assert bucket.dense.slots.view(8, 128)[b:].eq(steps.scratch_slot).all()
    assert mask[b:, 0].eq(0).all() and mask[b:, 1:].eq(float("-inf")).all() and mask[:b, w:].eq(float("-inf")).all()
    assert bucket.ids[0, b:].eq(0).all() and bucket.pos[0, b:].eq(0).all()


def test_buckets_past_the_number_kept_are_dropped_least_recently_used_first(dense, caplog):
    """One bucket kept: each new (rows, width) drops the last one (logged) and makes its own buffers
    again; the steps stay the eager path's."""
    pc = PromptCache(make_model("llama"), make_tokenizer())
    pc.add_schema(SCHEMA)
    want, want_logits, _ = serve(pc, pml_specs(pc), [12, 3, 12])
    steps = CapturedSteps(pc.runner, batches=BATCHES, width=WIDTH, kept=1)
    with caplog.at_level(logging.INFO, logger="promptcache.engine.serving_core.graphs"):
        got, got_logits, _ = serve(pc, pml_specs(pc), [12, 3, 12], forward=steps.forward)
    assert_same_steps(got_logits, want_logits)
    assert len(steps.buckets) == 1 and caplog.text.count("dropped (1 kept at most)") >= 2


def test_bad_bucket_sizes_are_refused():
    pc = PromptCache(make_model("llama"), make_tokenizer())
    with pytest.raises(ValueError, match="increasing"):
        CapturedSteps(pc.runner, batches=(4, 2))
    with pytest.raises(ValueError, match="width"):
        CapturedSteps(pc.runner, width=0)


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@cuda
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_captured_graphs_replay_the_uncaptured_static_steps_on_the_gpu(dtype):
    """On a GPU: each bucket's step captured once, then replayed; the served batch's logits as the
    same static steps run uncaptured (the same shapes and kernels: float32 within 1e-4, bfloat16
    within its rounding; compared up to the first step whose greedy tokens differ, after which the
    two runs read other tokens), the same tokens in float32. (The tests above, run with
    PROMPTCACHE_TEST_DEVICE=cuda, hold the captured steps to the eager paged path and the oracle.)"""
    from promptcache.models.loading import load_model

    model, tok = load_model("embedded", device="cuda", dtype=dtype)
    pc = PromptCache(model, tok)
    pc.add_schema(SCHEMA)
    runs = []
    for capture in (False, True):
        steps = CapturedSteps(pc.runner, batches=BATCHES, width=WIDTH)
        steps.capture = capture
        runs.append((*serve(pc, pml_specs(pc), [12, 3, 12], forward=steps.forward)[:2], steps))
    (plain, plain_logits, uncaptured), (got, got_logits, steps) = runs
    assert steps.capture_error is None, steps.capture_error
    assert uncaptured.replayed == 0 and steps.replayed == steps.static_steps > 0
    assert len(steps.capture_seconds) == len(steps.buckets)  # each bucket captured once
    tol = TOL if dtype == "float32" else 2e-2
    compared = 0
    for a, b in zip(got_logits, plain_logits):
        assert a.shape == b.shape
        assert (a - b).abs().max().item() <= tol * max(1.0, b.abs().max().item()), compared
        compared += 1
        if not torch.equal(a.argmax(-1), b.argmax(-1)):
            break
    assert compared >= 3
    if dtype == "float32":
        assert [r.token_ids for r in got] == [r.token_ids for r in plain]
