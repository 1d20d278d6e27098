"""Window-aware storage (``StoreConfig.window_aware``): disk and Redis keep, in sliding-window
layers, only the last ``window`` tokens of a state (what a later position can see), say so in
the record, and read the state back whole; prompts served from such states stay exact."""

from __future__ import annotations

import pytest
import torch

from promptcache import EngineConfig, PromptCache
from promptcache.store import StoreConfig, build_store, codec
from promptcache.store.codec import Trim, kept_tokens, trim, untrim

WINDOWS = (4, None, 4)


def states(n: int, seed: int = 0) -> torch.Tensor:
    torch.manual_seed(seed)
    return torch.randn(3, 2, 2, n, 8)  # [L, 2, H, n, D]


def test_a_trim_keeps_each_sliding_layers_last_window_tokens_and_global_layers_whole():
    assert kept_tokens(WINDOWS, 3) is None  # shorter than the window: nothing to drop
    assert kept_tokens((None, None), 50) is None and kept_tokens(None, 50) is None
    t = kept_tokens(WINDOWS, 10)
    assert t == Trim(10, (4, 10, 4)) and t.dropped == 12
    kv = states(10)
    packed = trim(kv, t)
    assert packed.shape == (2, 2, 18, 8)
    back = untrim(packed, t)
    assert torch.equal(back[1], kv[1])  # the global layer whole
    assert torch.equal(back[[0, 2], :, :, 6:], kv[[0, 2], :, :, 6:])  # the last 4 tokens of sliding layers
    assert not back[[0, 2], :, :, :6].any()  # dropped: zero, never read


def test_the_codec_stores_the_trim_proves_it_and_reads_the_state_back_whole(tmp_path):
    kv = states(10)
    whole, _ = codec.encode({"kv": ("k1", kv)})
    trimmed, _ = codec.encode({"kv": ("k1", kv)}, windows=WINDOWS)
    assert len(trimmed) < len(whole) - 12 * 2 * 2 * 8 * 4 + 200  # 12 token entries of 2 x 2 x 8 floats dropped
    expect = codec.StateInfo("k1", "float32", (3, 2, 2, 10, 8))
    got = codec.decode(trimmed, "kv", expect)
    assert got.shape == kv.shape
    assert torch.equal(got, untrim(trim(kv, kept_tokens(WINDOWS, 10)), kept_tokens(WINDOWS, 10)))
    path = tmp_path / "s.safetensors"
    codec.write_file(path, {"kv": ("k1", kv)}, windows=WINDOWS)
    assert torch.equal(codec.StatesFile(path).read("kv", expect), got)
    # the record's trim is covered by the checksum: a changed "kept" is corruption, not other states
    forged = bytearray(trimmed)
    at = bytes(forged).index(b'\\"kept\\": [4, 10, 4]')
    forged[at: at + len(b'\\"kept\\": [4, 10, 4]')] = b'\\"kept\\": [4, 10, 4]'.replace(b"[4, 10, 4]", b"[5, 10, 3]")
    with pytest.raises(codec.CodecError, match="checksum"):
        codec.decode(bytes(forged), "kv", expect)


def test_only_the_tiers_that_serialize_trim_and_only_when_asked(tmp_path):
    off = build_store("cpu", StoreConfig(spill_dir=str(tmp_path / "a")), WINDOWS)
    on = build_store("cpu", StoreConfig(spill_dir=str(tmp_path / "b"), window_aware=True), WINDOWS)
    assert all(t.windows is None for t in off.tiers)
    assert [t.windows for t in on.tiers] == [None, WINDOWS]  # host memory whole, disk trimmed
    kv = states(10)
    for store in (off, on):
        disk = store.tiers[-1]
        disk.put("k", kv)
        assert disk.get("k").shape == kv.shape
        disk.flush()  # the write-behind default queues the file; flush waits for it
    sizes = [next((tmp_path / d).glob("*.safetensors")).stat().st_size for d in ("a", "b")]
    assert sizes[0] - sizes[1] >= 12 * 2 * 2 * 8 * 4 - 200


READ_AFTER = ['<prompt schema="trip"><tokyo/><cheap/> Highlight the food and keep it short.</prompt>',
              '<prompt schema="trip"><paris/><cheap/><note/> Now.</prompt>',  # an uncached module between
              '<prompt schema="trip"><paris/><cheap/></prompt>']  # no new tokens: the last cached one runs


def test_prompts_served_from_trimmed_states_on_disk_equal_the_definition(tmp_path):
    """A tiny Gemma 3 with a 4-position window whose modules all went to disk trimmed (no memory
    budget): travel prompts that read every module from after it (no parameter argument before a
    module: see codec's note) at recompute=0 equal the definition windowed by position."""
    from oracle import definition_greedy, definition_state
    from tiny import gemma3_model as gemma3, make_tokenizer
    from trip import SCHEMA, serve_together

    config = EngineConfig(store=StoreConfig(host_budget=0, spill_dir=str(tmp_path), window_aware=True))
    pc = PromptCache(gemma3(4), make_tokenizer(), config)
    pc.add_schema(SCHEMA)
    schema = pc.schema("trip").layout
    disk = pc.store.tiers[-1]
    assert disk.windows == (4, None, 4) and disk.bytes_used > 0
    full = sum(pc.runner.stored_spec.bytes_per_token * len(s.token_ids) for s in schema.spans)
    assert disk.bytes_used < full  # what the modules of more than 4 tokens dropped
    reqs = serve_together(pc, READ_AFTER, max_new=6, budget=5)
    for prompt, req in zip(READ_AFTER, reqs):
        assert req.error is None, (prompt, req.error)
        layout = pc.layout(prompt)
        ref, _, _ = definition_state(pc.model, schema, layout)
        assert torch.max(torch.abs(req.prefill.logits - ref)).item() <= 1e-4, prompt
        assert req.token_ids == definition_greedy(pc.model, schema, layout, 6, eos=3), prompt
        assert req.prefill.hit_tiers.get("disk", 0) > 0
