"""Position-independent modules (``models/relocate.py``): stored states moved to new positions
must equal states encoded at those positions, for every rotary and ALiBi family and for scaled
ropes; learned absolute positions are refused.

Every forward runs through ``Adapter.forward`` on a ``SpliceCache`` so ALiBi models see the
key positions stored beside the states (the same path the engine uses).
"""

from __future__ import annotations

import functools

import pytest
import torch

from promptcache.models.splice import SpliceCache
from promptcache.models import UnsupportedModelError, get_adapter
from promptcache.models.relocate import can_relocate, relocate, rope_spec
from tiny import DEVICE, FAMILIES, VOCAB, make_model

LOGITS_TOL = 1e-3
KEYS_TOL = 1e-4
DOC_LEN, QUERY_LEN = 40, 4
DELTAS = (37, 300)
LEARNED = ("gpt2", "opt")
REFUSED = (*LEARNED, "falcon_alibi")  # falcon_alibi: bfloat16 bias, see test below
RELOCATABLE = [f for f in FAMILIES if f not in REFUSED]


def _tokens(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(8, VOCAB, (n,), generator=g).tolist()  # past the special tokens


DOC, DOC2, QUERY = _tokens(DOC_LEN, 1), _tokens(DOC_LEN - 11, 2), _tokens(QUERY_LEN, 3)


# -- models beyond tests/tiny.py: scaled and partial ropes ----------------------------------------
def _extra_configs():
    from transformers import LlamaConfig, Phi3Config

    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024)
    theta = {"rope_theta": 10000.0}
    return {
        "llama_linear": lambda: LlamaConfig(**common, rope_parameters={"rope_type": "linear", "factor": 2.0, **theta}),
        # original length 64: head_dim 16 has wavelengths below 16, between 16 and 64 and above 64,
        # so all three llama3 branches (kept, smoothed, scaled) are exercised
        "llama3": lambda: LlamaConfig(**common, rope_parameters={
            "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64, **theta}),
        # yarn's attention_scaling (~1.14) is baked into stored keys once; relocation must not reapply it
        "llama_yarn": lambda: LlamaConfig(**common, rope_parameters={
            "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256, **theta}),
        "llama_dynamic": lambda: LlamaConfig(**common, rope_parameters={
            "rope_type": "dynamic", "factor": 2.0, **theta}),
        "phi3_partial": lambda: Phi3Config(**common, pad_token_id=1, partial_rotary_factor=0.5),
        "phi3_longrope": lambda: Phi3Config(**common, pad_token_id=1, rope_parameters={
            "rope_type": "longrope", "short_factor": [1.0, 1.1, 1.3, 1.6, 2.0, 2.5, 3.0, 3.5],
            "long_factor": [1.5, 2.0, 3.0, 4.0, 6.0, 8.0, 12.0, 16.0],
            "original_max_position_embeddings": 512, **theta}),
    }


EXTRA = sorted(_extra_configs())


@functools.lru_cache(maxsize=None)
def _model(name: str):
    if name in FAMILIES:
        return make_model(name)
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    config = _extra_configs()[name]()
    config.bos_token_id, config.eos_token_id, config.pad_token_id = 2, 3, 1
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # same widened init as tests/tiny.py
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.2)
    return model.to(DEVICE).eval()


# -- helpers ----------------------------------------------------------------------------------------
def _encode(model, ids: list[int], start: int) -> torch.Tensor:
    """States of ``ids`` encoded alone at positions start..: [L, 2, H, n, D]."""
    adapter, device = get_adapter(model), model.device
    cache = SpliceCache(adapter.kv_spec(), len(ids), device=device)
    pos = torch.arange(start, start + len(ids), device=device)[None]
    adapter.forward(torch.tensor([ids], device=device), pos, cache)
    return cache.read(0, len(ids))


def _query(model, kv: torch.Tensor, positions: torch.Tensor, start: int) -> torch.Tensor:
    """Logits [QUERY_LEN, V] of each query token, run one at a time at start.. on top of kv."""
    adapter, device = get_adapter(model), model.device
    n = kv.shape[3]
    cache = SpliceCache(adapter.kv_spec(), n + QUERY_LEN, device=device)
    cache.write(0, kv, positions.to(device))
    cache.set_length(n)
    out = [adapter.forward(torch.tensor([[t]], device=device), torch.tensor([[start + i]], device=device), cache)[0]
           for i, t in enumerate(QUERY)]
    return torch.stack(out)


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return torch.max(torch.abs(a - b)).item()


# -- one document moved -------------------------------------------------------------------------------
@pytest.mark.parametrize("delta", DELTAS)
@pytest.mark.parametrize("name", RELOCATABLE + EXTRA)
def test_relocated_equals_encoded_at_target(name, delta):
    model = _model(name)
    adapter = get_adapter(model)
    assert adapter.can_relocate() and can_relocate(adapter)
    kv0 = _encode(model, DOC, 0)
    before = kv0.clone()
    moved = relocate(adapter, kv0, delta)
    assert torch.equal(kv0, before), "relocate must not modify its input"
    direct = _encode(model, DOC, delta)
    n = len(DOC)

    ref = _query(model, direct, torch.arange(delta, delta + n), delta + n)
    got = _query(model, moved, torch.arange(delta, delta + n), delta + n)
    assert _max_diff(got, ref) <= LOGITS_TOL
    assert torch.equal(moved[:, 1], kv0[:, 1]), "values carry no position"
    if adapter.positional == "rotary":
        assert _max_diff(moved[0, 0], direct[0, 0]) <= KEYS_TOL  # layer 0 keys: rotation only
    else:
        assert torch.equal(moved, kv0)  # ALiBi: only the position IDs move


@pytest.mark.parametrize("name", ["llama", "gpt_neox", "llama_yarn", "bloom"])
def test_relocate_backwards(name):
    """Moving left (negative delta) is as exact as moving right."""
    model = _model(name)
    adapter = get_adapter(model)
    n, src, dst = len(DOC), 300, 37
    moved = relocate(adapter, _encode(model, DOC, src), dst - src)
    direct = _encode(model, DOC, dst)
    pos = torch.arange(dst, dst + n)
    assert _max_diff(_query(model, moved, pos, dst + n), _query(model, direct, pos, dst + n)) <= LOGITS_TOL


# -- two documents, each encoded alone at 0, placed contiguously (a RAG document store) -------------
@pytest.mark.parametrize("name", RELOCATABLE + EXTRA)
def test_documents_spliced_contiguously(name):
    """Definition: encode each document alone at its final positions, concatenate, run the query."""
    model = _model(name)
    adapter = get_adapter(model)
    start = 11  # after a (notional) system prompt
    a, b = len(DOC), len(DOC2)
    spans = [(DOC, start), (DOC2, start + a)]
    moved = torch.cat([relocate(adapter, _encode(model, ids, 0), at) for ids, at in spans], dim=3)
    direct = torch.cat([_encode(model, ids, at) for ids, at in spans], dim=3)
    pos = torch.arange(start, start + a + b)
    ref = _query(model, direct, pos, start + a + b)
    got = _query(model, moved, pos, start + a + b)
    assert _max_diff(got, ref) <= LOGITS_TOL


# -- rope internals -----------------------------------------------------------------------------------
def test_rope_spec_reads_the_models_own_frequencies():
    spec = rope_spec(get_adapter(_model("llama_linear")))
    assert torch.equal(spec.inv_freq, _model("llama_linear").model.rotary_emb.inv_freq.double().cpu())
    assert rope_spec(get_adapter(_model("gpt_neox"))).rotary_dim == 4  # head_dim 16, rotary_pct 0.25
    assert rope_spec(get_adapter(_model("phi3_partial"))).rotary_dim == 8
    assert rope_spec(get_adapter(_model("llama"))).rotary_dim == 16


def test_partial_rotary_channels_pass_through():
    model = _model("gpt_neox")
    kv = _encode(model, DOC, 0)
    moved = relocate(get_adapter(model), kv, 300)
    assert torch.equal(moved[:, 0, ..., 4:], kv[:, 0, ..., 4:])
    assert not torch.equal(moved[:, 0, ..., :4], kv[:, 0, ..., :4])


def test_rotations_compose_and_zero_is_identity():
    adapter = get_adapter(_model("llama_yarn"))
    kv = _encode(_model("llama_yarn"), DOC, 0)
    assert torch.equal(relocate(adapter, kv, 0), kv)
    there_and_back = relocate(adapter, relocate(adapter, kv, 123_456), -123_456)
    assert _max_diff(there_and_back, kv) <= 1e-5


def test_large_delta_matches_float64_rotation():
    """Independent reference: rotate_half pairs (x1, x2) are the complex number x1 + i x2, turned
    by e^(i d f) in complex128. A float32 angle would be off by ~0.03 rad at this delta."""
    model = _model("gpt_neox")  # partial rotary: channels 0..3 rotate, pairs (0, 2), (1, 3)
    adapter = get_adapter(model)
    kv, delta = _encode(model, DOC, 0), 1_000_003
    spec = rope_spec(adapter)  # inv_freq: float64 on the CPU, where the reference is computed
    half = spec.rotary_dim // 2
    k = kv[:, 0].double().cpu()
    z = torch.complex(k[..., :half], k[..., half : 2 * half]) * torch.polar(torch.ones(half, dtype=torch.float64),
                                                                          delta * spec.inv_freq)
    want = torch.cat([z.real, z.imag, k[..., 2 * half :]], dim=-1)
    assert _max_diff(relocate(adapter, kv, delta)[:, 0].double().cpu(), want) <= 1e-5


def test_half_precision_keeps_dtype_and_device():
    adapter = get_adapter(_model("llama"))
    kv = _encode(_model("llama"), DOC, 0)
    moved = relocate(adapter, kv.bfloat16(), 37)
    assert moved.dtype == torch.bfloat16 and moved.device == kv.device
    assert _max_diff(moved.float(), relocate(adapter, kv, 37)) <= 0.05  # one bf16 rounding


# -- refusals and bad input ---------------------------------------------------------------------------
@pytest.mark.parametrize("name", LEARNED)
def test_learned_positions_refused(name):
    adapter = get_adapter(_model(name))
    assert not adapter.can_relocate() and not can_relocate(adapter)
    kv = torch.zeros(adapter.kv_spec().layers, 2, adapter.kv_heads(), 3, adapter.head_dim(), device=_model(name).device)
    with pytest.raises(UnsupportedModelError, match="learned absolute position"):
        relocate(adapter, kv, 5)


def test_falcon_alibi_refused_because_its_bias_is_rounded():
    model = _model("falcon_alibi")
    adapter = get_adapter(model)
    assert not adapter.can_relocate()
    with pytest.raises(UnsupportedModelError, match="bfloat16"):
        relocate(adapter, _encode(model, DOC, 0), 37)
    # why: the model's own states are translation invariant only while bfloat16 holds every
    # position exactly (below 256 with this model's power-of-two slopes), not at 300..339
    at0 = _encode(model, DOC, 0)
    assert _max_diff(_encode(model, DOC, 37), at0) <= 1e-5
    assert _max_diff(_encode(model, DOC, 300), at0) > 1e-3


def test_bad_input_rejected():
    adapter = get_adapter(_model("llama"))
    kv = _encode(_model("llama"), DOC, 0)
    with pytest.raises(ValueError, match=r"\[2, 2, 2, n, 16\]"):
        relocate(adapter, kv[:, :, :1], 5)
    with pytest.raises(ValueError, match="integer"):
        relocate(adapter, kv, 2.5)
