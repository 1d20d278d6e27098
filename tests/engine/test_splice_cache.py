"""SpliceCache / SpliceLayer: transformers' cache-layer contract, slot-addressed writes, masks,
and the adapter seams that must fail loudly (self-check, ALiBi hooks, unsupported layer ops)."""

from __future__ import annotations

import pytest
import torch
from transformers.cache_utils import CacheLayerMixin

from promptcache.models.splice import CachePool, KVSpec, SpliceCache, SpliceLayer
from promptcache.models import UnsupportedModelError, get_adapter
from promptcache.models import masks
from promptcache.models.families import Bloom, LlamaFamily
from tiny import fresh_model, make_model

SPEC = KVSpec(layers=2, kv_heads=2, head_dim=4, dtype=torch.float32)


def _states(t: int, fill: float, b: int = 1) -> torch.Tensor:
    return torch.full((b, SPEC.kv_heads, t, SPEC.head_dim), fill)


# -- the layer contract ----------------------------------------------------------------------------
def test_layer_implements_the_contract_itself():
    cache = SpliceCache(SPEC, 4)
    layer = cache.layers[0]
    assert isinstance(layer, CacheLayerMixin) and isinstance(layer, SpliceLayer)
    k, v = layer.update(_states(3, 1.0), _states(3, 2.0))
    assert k.shape == (1, 2, 3, 4) and bool((k == 1).all()) and bool((v == 2).all())
    assert layer.get_seq_length() == 3 and layer.get_mask_sizes(2) == (5, 0) and layer.get_max_length() == -1
    k, _ = layer.update(_states(5, 3.0), _states(5, 4.0))  # grows past the capacity
    assert k.shape[2] == 8 and bool((k[:, :, :3] == 1).all()) and bool((k[:, :, 3:] == 3).all())
    layer.crop(-2)
    assert layer.get_seq_length() == 6
    layer.crop(4)  # transformers' legacy form: keep at most 4
    assert layer.get_seq_length() == 4
    layer.reset()
    assert layer.get_seq_length() == 0 and layer.keys.shape[2] == 0
    assert cache.is_initialized and cache.is_sliding == [False, False] and cache.is_croppable


@pytest.mark.parametrize("op", ["assign_keys", "assign_values", "reorder", "select", "repeat", "offload", "prefetch"])
def test_unsupported_layer_operations_raise(op):
    cache = SpliceCache(SPEC, 4)
    cache.layers[0].update(_states(2, 1.0), _states(2, 1.0))
    calls = {
        "assign_keys": lambda: setattr(cache.layers[0], "keys", torch.zeros(1)),
        "assign_values": lambda: setattr(cache.layers[0], "values", torch.zeros(1)),
        "reorder": lambda: cache.reorder_cache(torch.tensor([0])),
        "select": lambda: cache.batch_select_indices(torch.tensor([0])),
        "repeat": lambda: cache.batch_repeat_interleave(2),
        "offload": lambda: cache.layers[0].offload(),
        "prefetch": lambda: cache.layers[0].prefetch(),
    }
    with pytest.raises(NotImplementedError, match="SpliceCache does not support"):
        calls[op]()
    assert cache.layers[0].get_seq_length() == 2 and bool((cache.layers[0].keys == 1).all())


def test_lazy_initialization_checks_the_shape():
    cache = SpliceCache(SPEC, 4)
    cache.layers[0].lazy_initialization(_states(1, 0.0), _states(1, 0.0))
    with pytest.raises(ValueError, match="do not fit"):
        cache.layers[0].lazy_initialization(torch.zeros(1, 3, 1, 4), torch.zeros(1, 3, 1, 4))


# -- slot-addressed writes ---------------------------------------------------------------------------
def _filled(n: int) -> SpliceCache:
    cache = SpliceCache(SPEC, n)
    for layer in cache.layers:
        layer.update(torch.arange(n, dtype=torch.float32).view(1, 1, n, 1).expand(1, 2, n, 4).clone(),
                     _states(n, -1.0))
    cache.positions[0, :n] = torch.arange(100, 100 + n)
    return cache


def test_slot_write_overwrites_and_extends():
    cache = _filled(5)
    cache.resident = {0: ("a", 2), 2: ("b", 3)}
    pos = torch.tensor([[7, 8, 9]])
    with cache.slot_write(pos, torch.tensor([3, 5, 6])) as kv_len:
        assert kv_len == 7
        k, v = cache.layers[0].update(_states(3, 50.0), _states(3, 60.0))
        cache.layers[1].update(_states(3, 50.0), _states(3, 60.0))
    assert cache.length == 7 and k.shape[2] == 7 and cache.pending is None
    assert k[0, 0, :, 0].tolist() == [0, 1, 2, 50, 4, 50, 50]
    assert cache.positions[0, :7].tolist() == [100, 101, 102, 7, 104, 8, 9]
    assert cache.resident == {0: ("a", 2)}, "a resident span whose slots were rewritten is forgotten"


def test_slot_write_per_row():
    cache = SpliceCache(SPEC, 4, batch=2)
    for layer in cache.layers:
        layer.update(_states(2, 1.0, b=2), _states(2, 1.0, b=2))
    slots = torch.tensor([[0, 2], [1, 2]])
    with cache.slot_write(torch.tensor([[5, 6], [7, 8]]), slots):
        for layer in cache.layers:
            k, _ = layer.update(_states(2, 9.0, b=2), _states(2, 9.0, b=2))
    assert k[0, 0, :, 0].tolist() == [9, 1, 9] and k[1, 0, :, 0].tolist() == [1, 9, 9]
    assert cache.positions[:, :3].tolist() == [[5, 0, 6], [0, 7, 8]]


@pytest.mark.parametrize("slots, match", [
    ([2, 7], "unwritten slots"),  # slots 5, 6 would stay garbage
    ([1, 1], "at most once"),
    ([-1, 5], ">= 0"),
    ([1, 2, 3], r"\[T\] = \[2\]"),
])
def test_bad_slot_writes_are_refused(slots, match):
    cache = _filled(5)
    with pytest.raises(ValueError, match=match):
        with cache.slot_write(torch.tensor([[1, 2]]), torch.tensor(slots)):
            pass
    assert cache.pending is None and cache.length == 5


def test_failed_forward_clears_the_pending_write():
    cache = _filled(5)
    with pytest.raises(RuntimeError, match="boom"):
        with cache.slot_write(torch.tensor([[1]]), torch.tensor([5])):
            raise RuntimeError("boom")
    assert cache.pending is None


def test_slot_causal_mask():
    m = masks.slot_causal(4, torch.tensor([1, 4, 5]), 6)[0, 0]  # rewrite slot 1, append 4, 5
    assert m.int().tolist() == [[1, 1, 1, 1, 0, 0],
                                [1, 1, 1, 1, 1, 0],
                                [1, 1, 1, 1, 1, 1]]
    m = masks.slot_causal(3, torch.tensor([2, 0]), 3)[0, 0]  # rewritten slots, in the given order
    assert m.int().tolist() == [[0, 1, 1], [1, 1, 1]]


def test_mask_is_validated():
    model = make_model("llama")
    adapter, device = get_adapter(model), model.device
    cache = SpliceCache(adapter.kv_spec(), 8, device=device)
    ids, pos = torch.tensor([[5, 6]], device=device), torch.tensor([[0, 1]], device=device)
    with pytest.raises(ValueError, match=r"\[1, 1, 2, 2\]"):
        adapter.forward(ids, pos, cache, attention_mask=torch.ones(1, 1, 2, 3, dtype=torch.bool, device=device))
    with pytest.raises(ValueError, match="BoolTensor"):
        adapter.forward(ids, pos, cache, attention_mask=torch.ones(1, 1, 2, 2, device=device))
    with pytest.raises(ValueError, match="attends to nothing"):
        adapter.forward(ids, pos, cache, attention_mask=torch.zeros(1, 1, 2, 2, dtype=torch.bool, device=device))


def test_masked_append_without_slots_equals_the_hot_path():
    model = make_model("qwen2")
    adapter, device = get_adapter(model), model.device
    ids, pos = torch.tensor([[5, 6, 7, 9]], device=device), torch.tensor([[0, 3, 4, 9]], device=device)
    hot = adapter.forward(ids, pos, SpliceCache(adapter.kv_spec(), 8, device=device))
    mask = torch.ones(4, 4, dtype=torch.bool, device=device).tril()[None, None]
    masked = adapter.forward(ids, pos, SpliceCache(adapter.kv_spec(), 8, device=device), attention_mask=mask)
    assert torch.max(torch.abs(masked - hot)).item() <= 1e-5


def test_pool_still_hands_out_caches():
    pool = CachePool(SPEC, "cpu")
    cache = pool.acquire(10, [])
    assert cache.capacity >= 10 and cache.resident == {}
    pool.release(cache)
    assert pool.acquire(10, []) is cache


# -- adapter seams -----------------------------------------------------------------------------------
def test_self_check_refuses_a_wrong_position_path():
    model = fresh_model("bloom")
    adapter = Bloom(model)
    try:
        adapter.self_check()  # the real one passes
        adapter.slopes = adapter.slopes * 2  # a hook that builds the wrong bias
        with pytest.raises(UnsupportedModelError, match="self-check failed"):
            adapter.self_check()
    finally:
        adapter.close()

    class Broken(LlamaFamily):
        def forward(self, input_ids, position_ids, cache, **kw):  # rotary distances doubled
            return super().forward(input_ids, position_ids * 2, cache, **kw)

    with pytest.raises(UnsupportedModelError, match="self-check failed.*differs from the stock forward"):
        Broken(fresh_model("llama")).self_check()


def test_get_adapter_checks_once_per_model():
    model = fresh_model("opt")
    first = get_adapter(model)
    assert get_adapter(model) is first


@pytest.mark.parametrize("family, arg", [("bloom", "alibi"), ("mpt", "position_bias"), ("falcon_alibi", "alibi")])
def test_alibi_hook_refuses_a_renamed_argument(family, arg):
    model = fresh_model(family)
    adapter = get_adapter(model)

    def rename(module, args, kwargs):  # what a transformers release renaming the argument looks like
        kwargs[arg + "_renamed"] = kwargs.pop(arg)
        return args, kwargs

    handle = adapter.blocks()[0].register_forward_pre_hook(rename, with_kwargs=True, prepend=True)
    device = model.device
    ids, pos = torch.tensor([[5, 6]], device=device), torch.tensor([[0, 1]], device=device)
    with pytest.raises(UnsupportedModelError, match=rf"'{arg}'.*transformers \d"):
        adapter.forward(ids, pos, SpliceCache(adapter.kv_spec(), 4, device=device))
    handle.remove()
    adapter.forward(ids, pos, SpliceCache(adapter.kv_spec(), 4, device=device))


def test_alibi_forward_refuses_hooks_that_did_not_run():
    model = fresh_model("mpt")
    adapter = get_adapter(model)
    adapter.close()  # as if the model's blocks had been renamed: the hooks sit on nothing that runs
    device = model.device
    ids, pos = torch.tensor([[5, 6]], device=device), torch.tensor([[0, 1]], device=device)
    with pytest.raises(UnsupportedModelError, match="ran 0 times for 2 blocks"):
        adapter.forward(ids, pos, SpliceCache(adapter.kv_spec(), 4, device=device))


@pytest.mark.parametrize("family, want", [
    ("llama", 1024), ("gpt2", 1024), ("opt", 1024), ("mpt", 1024), ("bloom", None), ("gpt_neox", 1024),
])
def test_max_positions(family, want):
    assert get_adapter(make_model(family)).max_positions == want


def test_max_positions_of_bounded_ropes_is_the_original_context():
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, max_position_embeddings=4096,
                         rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0,
                                          "original_max_position_embeddings": 512})
    adapter = get_adapter(AutoModelForCausalLM.from_config(config).eval())
    assert adapter.max_positions == 512 and adapter.max_position() == 511


def test_a_refused_mask_leaves_the_cache_untouched():
    model = make_model("llama")
    adapter, device = get_adapter(model), model.device
    cache = SpliceCache(adapter.kv_spec(), 8, device=device)
    adapter.forward(torch.tensor([[5, 6, 7]], device=device), torch.tensor([[0, 1, 2]], device=device), cache)
    before, positions = cache.buf[:, :, :, :, :3].clone(), cache.positions.clone()
    with pytest.raises(ValueError, match=r"\[1, 1, 2, 4\]"):
        adapter.forward(torch.tensor([[8, 9]], device=device), torch.tensor([[9, 9]], device=device), cache,
                        write_slots=torch.tensor([1, 3], device=device),
                        attention_mask=torch.ones(1, 1, 2, 3, dtype=torch.bool, device=device))
    assert cache.length == 3 and torch.equal(cache.positions, positions)
    assert torch.equal(cache.buf[:, :, :, :, :3], before)
