"""kv_dtype: module states stored in bfloat16/float16 while the model computes in float32.

Bytes per cached token are the theory for the stored dtype in memory, on disk (spill files) and
in compiled artifacts; artifacts record the dtype and refuse another engine's unless converted;
a bfloat16-stored prompt's logits stay close to float32 storage (not an exactness test: the
float32 exactness tests run with kv_dtype=None and are unchanged). Also: the first prompt finds the
schema's default pass already placed at registration.
"""

from __future__ import annotations

import json
import struct

import pytest
import torch

from promptcache import PromptCache
from promptcache.artifact import ArtifactError
from promptcache.engine import EngineConfig, RunnerConfig, StoreConfig
from tiny import ON_CPU, make_model, make_tokenizer

SCHEMA = """<schema name="s">
  <system>You are a travel planner.</system>
  <user>
    <module name="plan">Plan a trip of <parameter name="days" length="3"/> days.</module>
    <union scaffold="paris">
      <module name="paris">Paris is the capital of France, famous for museums and cafes.</module>
      <module name="tokyo">Tokyo is a huge city in Japan with temples and food markets.</module>
    </union>
  </user>
</schema>"""
PROMPT = '<prompt schema="s"><plan days="3"/><tokyo/> Highlight the food.</prompt>'
SIZE = {"float32": 4, "bfloat16": 2, "float16": 2}


def engine(kv_dtype, **store) -> PromptCache:
    torch.manual_seed(0)
    return PromptCache(make_model("llama"), make_tokenizer(), EngineConfig(runner=RunnerConfig(kv_dtype=kv_dtype), store=StoreConfig(**store)))


def theory(pc: PromptCache, dtype: str) -> int:
    s = pc.spec
    return 2 * s.layers * s.kv_heads * s.head_dim * SIZE[dtype]


def memory_bytes_per_token(pc: PromptCache, entry) -> float:
    states = [pc.store.get(k)[0] for k in entry.keys.values()]
    assert {t.dtype for t in states} == {pc.runner.stored_spec.dtype}
    return sum(t.numel() * t.element_size() for t in states) / entry.stored_tokens


@pytest.mark.parametrize("kv_dtype", ["bfloat16", "float16"])
def test_memory_bytes_per_token_is_half_of_float32(kv_dtype):
    full, half = engine(None), engine(kv_dtype)
    e32, e16 = full.add_schema(SCHEMA), half.add_schema(SCHEMA)
    assert e32.bytes_per_token == theory(full, "float32") and e16.bytes_per_token == theory(half, kv_dtype)
    assert e16.bytes_per_token * 2 == e32.bytes_per_token
    assert memory_bytes_per_token(half, e16) == pytest.approx(theory(half, kv_dtype), rel=0.01)
    assert memory_bytes_per_token(full, e32) == pytest.approx(theory(full, "float32"), rel=0.01)
    assert half.spec.dtype == torch.float32  # the model still computes in float32


def test_disk_spill_bytes_per_token_is_half(tmp_path):
    sizes = {}
    for dtype in ("float32", "bfloat16"):
        spill = tmp_path / dtype
        pc = engine(dtype, host_budget=1, spill_dir=str(spill))  # every state goes to disk
        entry = pc.add_schema(SCHEMA)
        for k in entry.keys.values():
            assert pc.store.get(k)[0].dtype == getattr(torch, dtype)
        pc.store.persist()  # the spill folder's default policy writes behind: on disk once this returns
        files = list(spill.rglob("*.safetensors"))
        assert files, "no state was spilled to disk"
        data = sum(f.stat().st_size - 8 - struct.unpack("<Q", f.read_bytes()[:8])[0] for f in files)  # no header
        sizes[dtype] = data / entry.stored_tokens
        assert sizes[dtype] == pytest.approx(theory(pc, dtype), rel=0.01)
    assert sizes["bfloat16"] * 2 == sizes["float32"]


def test_artifact_records_dtype_and_is_half(tmp_path):
    pcs = {d: engine(d) for d in ("float32", "bfloat16")}
    per_token = {}
    for d, pc in pcs.items():
        out = pc.compile(SCHEMA, tmp_path / d)
        manifest = json.loads((out / "manifest.json").read_text())
        assert manifest["kv_spec"]["dtype"] == d and manifest["dtype"] == d
        entry = pc.schema("s")
        data = sum(manifest["states"]["nbytes"].values())
        per_token[d] = data / entry.stored_tokens
        assert per_token[d] == pytest.approx(theory(pc, d), rel=0.01)
    assert per_token["bfloat16"] * 2 == per_token["float32"]


def test_artifact_of_another_dtype_is_refused_unless_converted(tmp_path):
    out = engine("float32").compile(SCHEMA, tmp_path / "a")
    pc = engine("bfloat16")
    with pytest.raises(ArtifactError, match="stored in float32, this engine stores bfloat16.*convert=True"):
        pc.load_compiled(out)
    entry = pc.load_compiled(out, convert=True)
    assert all(pc.store.get(k)[0].dtype == torch.bfloat16 for k in entry.keys.values())
    ref = engine("bfloat16")
    ref.add_schema(SCHEMA)
    assert torch.equal(pc.prefill(PROMPT).logits, ref.prefill(PROMPT).logits)  # same rounding of the same states


def test_bfloat16_storage_logits_close_to_float32():
    full, half = engine(None), engine("bfloat16")
    full.add_schema(SCHEMA)
    half.add_schema(SCHEMA)
    a, b = full.prefill(PROMPT).logits, half.prefill(PROMPT).logits
    assert b.dtype == torch.float32
    diff = (a - b).abs().max().item()
    assert 0 < diff < 0.05 * a.abs().max().item()  # rounded states, not exact; close
    assert a.argmax() == b.argmax()


def test_float32_default_unchanged_by_kv_dtype_float32():
    a, b = engine(None), engine("float32")
    a.add_schema(SCHEMA)
    b.add_schema(SCHEMA)
    assert torch.equal(a.prefill(PROMPT).logits, b.prefill(PROMPT).logits)


@pytest.mark.parametrize("kv_dtype", [None, "bfloat16"])
def test_first_prompt_finds_its_modules_in_place(kv_dtype):
    """Registration places the default pass in the prewarmed buffer (CPU): the first prompt of a
    fresh engine that imports modules in schema order copies nothing, and its logits are those
    of a prompt whose modules were copied. Off the CPU nothing is prewarmed (``prewarm`` is a
    CPU path): the first prompt copies what a prompt after ``forget_placement`` copies."""
    pc = engine(kv_dtype)
    pc.add_schema(SCHEMA)
    prompt = '<prompt schema="s"><plan days="3"/><paris/> Highlight the food.</prompt>'
    first = pc.prefill(prompt)
    assert (first.bytes_copied == 0) == ON_CPU and first.cached_tokens > 0
    pc.forget_placement()
    copied = pc.prefill(prompt)
    assert copied.bytes_copied > 0 and torch.equal(first.logits, copied.logits)
    assert ON_CPU or first.bytes_copied == copied.bytes_copied
