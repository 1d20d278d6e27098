"""CUDA paths: states served from host memory (pinned) and from device memory, copies overlapped
layer by layer with the forward, 16-bit stored states upcast on the GPU, generation and batched
decode on the GPU. Every test compares against the same engine on the CPU or against the
non-overlapped copy; all need a CUDA GPU (CI has none: ``eval/README.md`` "CUDA checks" records
the runs on a lent GPU).
"""

from __future__ import annotations

import pytest
import torch

from promptcache import PromptCache
from promptcache.models.splice import KVSpec, SpliceCache
from promptcache.engine import EngineConfig, RunnerConfig, StoreConfig
from promptcache.engine.prefill.plan import Segment
from tiny import fresh_model, make_tokenizer

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

SCHEMA = """<schema name="s">
  <system>You are a travel planner.</system>
  <user>
    <module name="plan">Plan a trip of <parameter name="days" length="3"/> days.</module>
    <union scaffold="paris">
      <module name="paris">Paris is the capital of France, famous for museums and cafes.</module>
      <module name="tokyo">Tokyo is a huge city in Japan with temples and food markets.</module>
    </union>
    <module name="tips">Pack light, carry cash, and learn a few words of the language.</module>
  </user>
</schema>"""
PROMPTS = ['<prompt schema="s"><plan days="3"/><tokyo/><tips/> Highlight the food.</prompt>',
           '<prompt schema="s"><plan days="5"/><paris/> Any museums?</prompt>',
           '<prompt schema="s"><tokyo/><tips/> What should I pack?</prompt>']


def engine(device: str, config: EngineConfig | None = None) -> PromptCache:
    model = fresh_model("llama", seed=0).to(device)  # never move the shared cached model
    pc = PromptCache(model, make_tokenizer(), config)
    pc.add_schema(SCHEMA)
    return pc


@pytest.fixture(scope="module")
def cpu():
    return engine("cpu")


HOST = StoreConfig(device_budget=0)  # states kept in (pinned) host memory, copied to the GPU per prompt


@pytest.mark.parametrize("config", [EngineConfig(), EngineConfig(runner=RunnerConfig(overlap_copies=True), store=HOST),
                                    EngineConfig(store=HOST),
                                    EngineConfig(store=StoreConfig(device_budget=0, pin_memory=False))],
                         ids=["device-tier", "host-tier-overlap", "host-tier-serial", "host-tier-unpinned"])
def test_gpu_tiers_match_cpu(cpu, config):
    gpu = engine("cuda", config)
    for text in PROMPTS:
        for _ in range(2):  # the second time modules may already be in place
            got, want = gpu.prefill(text), cpu.prefill(text)
            assert got.logits.device.type == "cuda"
            assert torch.max(torch.abs(got.logits.cpu() - want.logits)).item() <= 1e-4, (config, text)
        if config.store.device_budget == 0:
            assert set(got.hit_tiers) <= {"host"}, got.hit_tiers  # served from host memory, not the device


def test_overlapped_copy_equals_serial_copy_bit_for_bit():
    torch.manual_seed(0)
    spec = KVSpec(layers=6, kv_heads=4, head_dim=16, dtype=torch.float32)
    spans = [Segment(f"m{i}", torch.randn(6, 2, 4, n, 16).pin_memory(), torch.arange(10 * i, 10 * i + n))
             for i, n in enumerate([7, 300, 33])]
    out = {}
    for overlap in (True, False):
        cache = SpliceCache(spec, 512, device="cuda", overlap=overlap)
        cache.buf.fill_(float("nan"))  # an unwritten slot would show
        cache.place(spans)
        assert (cache.layer_ready is not None) == overlap
        out[overlap] = cache.read(0, cache.length).cpu()
        assert torch.equal(cache.positions[0, : cache.length].cpu(), torch.cat([seg.positions for seg in spans]))
    assert torch.equal(out[True], out[False])
    assert torch.equal(out[True], torch.cat([seg.kv for seg in spans], dim=3))


@pytest.mark.parametrize("kv_dtype", ["bfloat16", "float16"])
def test_sixteen_bit_states_upcast_on_the_gpu(kv_dtype):
    cpu16 = engine("cpu", EngineConfig(runner=RunnerConfig(kv_dtype=kv_dtype)))
    gpu16 = engine("cuda", EngineConfig(runner=RunnerConfig(kv_dtype=kv_dtype, overlap_copies=True),
                                       store=StoreConfig(device_budget=0)))
    for text in PROMPTS:
        got, want = gpu16.prefill(text), cpu16.prefill(text)
        # the same rounded states on both: only float32 arithmetic differs
        assert torch.max(torch.abs(got.logits.cpu() - want.logits)).item() <= 1e-4


def test_generation_on_the_gpu_equals_the_stock_model(cpu):
    gpu = engine("cuda", EngineConfig(store=StoreConfig(device_budget=0)))
    for text in PROMPTS:
        res = gpu.generate(text, max_new_tokens=12)
        assert res.token_ids == cpu.generate(text, max_new_tokens=12).token_ids
    plain = "<prompt><user>Name three rivers in Europe.</user></prompt>"
    ids = torch.tensor([gpu.layout(plain).token_ids], device="cuda")
    with torch.inference_mode():
        ref = gpu.model.generate(ids, max_new_tokens=12, do_sample=False, attention_mask=torch.ones_like(ids),
                                 pad_token_id=0)[0, ids.shape[1]:].tolist()
    got = gpu.generate(plain, max_new_tokens=12).token_ids
    assert got == ref[: len(got)] and len(got) >= 1


def test_batched_generate_on_the_gpu_equals_one_by_one():
    gpu = engine("cuda")
    expected = [gpu.generate(t, max_new_tokens=6, temperature=0.0).token_ids for t in PROMPTS]
    assert [g.token_ids for g in gpu.generate(list(PROMPTS), max_new_tokens=6, temperature=0.0)] == expected


def test_compiled_steps_with_cuda_graphs_equal_eager_steps_on_the_gpu():
    """engine/serving_core/graphs.py on CUDA: graphs between attention operations captured and replayed; the
    answers equal the eager paged steps' (float32 logits within 1e-4, the same greedy tokens)."""
    from promptcache.engine.serving_core.graphs import CompiledSteps
    from trip import serve_together

    pc = engine("cuda")  # float32 on the GPU
    want = serve_together(pc, PROMPTS)
    steps = CompiledSteps(pc.runner, buckets=(1, 2, 4, 8))
    got = serve_together(pc, PROMPTS, forward=steps.forward)
    got_again = serve_together(pc, PROMPTS, forward=steps.forward)  # replayed graphs
    for a, b, c in zip(want, got, got_again):
        assert torch.max(torch.abs(a.prefill.logits - b.prefill.logits)).item() <= 1e-4
        assert a.token_ids == b.token_ids == c.token_ids
    assert steps.compiled_steps > 0
