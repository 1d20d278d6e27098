"""An independent ALiBi reference for Bloom and MPT, not through the adapter or its hooks.

The attention is written here from the ALiBi paper: score(i, j) = q_i . k_j / sqrt(d)
- m_h * (p_i - p_j) with slopes m_h = 2^(-8 h / H), h = 1..H, from the tokens' position IDs;
only the model's weights (projections, norms, MLPs) are reused. The reference is first checked
against the stock forward at contiguous positions, then the adapter's hooked forward is checked
against it at positions with gaps, on top of a cache, and through slot writes with a custom mask.
"""

from __future__ import annotations

import math

import pytest
import torch

from promptcache.models.splice import SpliceCache
from promptcache.models import get_adapter
from tiny import VOCAB, make_model

TOL = 1e-4
FAMILIES = ("bloom", "mpt")


def _slopes(n_heads: int, device) -> torch.Tensor:
    assert n_heads & (n_heads - 1) == 0, "the tiny models have a power-of-two head count"
    return torch.tensor([2.0 ** (-8.0 * h / n_heads) for h in range(1, n_heads + 1)], device=device)  # [H]


def _attend(q, k, v, pos, visible, scale):
    """q, k, v: [T, H, D]; pos: [T]; visible: bool [T, T] (query, key). Returns [T, H * D]."""
    t, h, d = q.shape
    scores = torch.einsum("ihd,jhd->hij", q, k) * scale  # [H, T, T]
    dist = (pos[:, None] - pos[None, :]).float()  # p_i - p_j
    scores = scores - _slopes(h, q.device)[:, None, None] * dist[None]
    scores = scores.masked_fill(~visible[None], float("-inf"))
    return torch.einsum("hij,jhd->ihd", scores.softmax(-1), v).reshape(t, h * d)


@torch.inference_mode()
def reference_logits(model, family: str, ids: list[int], pos: list[int], visible: torch.Tensor) -> torch.Tensor:
    """Logits [T, V] of every token of one sequence at ``pos`` under ``visible`` [T, T]."""
    device = model.device
    t, pos_t = len(ids), torch.tensor(pos, device=device)
    ids_t, visible = torch.tensor(ids, device=device), visible.to(device)
    tr = model.transformer
    if family == "bloom":
        heads = model.config.n_head
        h = tr.word_embeddings_layernorm(tr.word_embeddings(ids_t))  # [T, C]
        for block in tr.h:
            att = block.self_attention
            qkv = att.query_key_value(block.input_layernorm(h)).view(t, heads, 3, -1)  # per head: q, k, v
            q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
            h = att.dense(_attend(q, k, v, pos_t, visible, 1 / math.sqrt(q.shape[-1]))) + h
            mlp = block.mlp
            h = mlp.dense_4h_to_h(mlp.gelu_impl(mlp.dense_h_to_4h(block.post_attention_layernorm(h)))) + h
        h = tr.ln_f(h)
    else:  # mpt
        heads = model.config.n_heads
        h = tr.wte(ids_t)
        for block in tr.blocks:
            q, k, v = (x.reshape(t, heads, -1) for x in block.attn.Wqkv(block.norm_1(h)).chunk(3, dim=-1))
            h = block.attn.out_proj(_attend(q, k, v, pos_t, visible, 1 / math.sqrt(q.shape[-1]))) + h
            ffn = block.ffn
            h = ffn.down_proj(ffn.act(ffn.up_proj(block.norm_2(h)))) + h
        h = tr.norm_f(h)
    return model.lm_head(h)


def _tokens(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(8, VOCAB, (n,), generator=g).tolist()


IDS = _tokens(14, 1)
GAPPED = [0, 1, 2, 3, 40, 41, 42, 43, 44, 90, 91, 200, 201, 202]  # three gaps
CAUSAL = torch.ones(len(IDS), len(IDS), dtype=torch.bool).tril()


@pytest.mark.parametrize("family", FAMILIES)
def test_reference_equals_stock_forward_at_contiguous_positions(family):
    model = make_model(family)
    with torch.inference_mode():
        stock = model(input_ids=torch.tensor([IDS], device=model.device)).logits[0]
    ref = reference_logits(model, family, IDS, list(range(len(IDS))), CAUSAL)
    assert torch.max(torch.abs(ref - stock)).item() <= TOL
    gapped = reference_logits(model, family, IDS, GAPPED, CAUSAL)
    assert torch.max(torch.abs(gapped[-1] - stock[-1])).item() > 1e-2, "positions must matter"


@pytest.mark.parametrize("family", FAMILIES)
def test_adapter_equals_reference_at_gapped_positions(family):
    model = make_model(family)
    adapter, device = get_adapter(model), model.device
    ref = reference_logits(model, family, IDS, GAPPED, CAUSAL)
    cache = SpliceCache(adapter.kv_spec(), len(IDS), device=device)
    got = adapter.forward(torch.tensor([IDS], device=device), torch.tensor([GAPPED], device=device), cache)[0]
    assert torch.max(torch.abs(got - ref[-1])).item() <= TOL
    # the same tokens in two forwards: the second reads the first's key positions from the cache
    cache = SpliceCache(adapter.kv_spec(), len(IDS), device=device)
    adapter.forward(torch.tensor([IDS[:6]], device=device), torch.tensor([GAPPED[:6]], device=device), cache)
    got = adapter.forward(torch.tensor([IDS[6:]], device=device), torch.tensor([GAPPED[6:]], device=device), cache)[0]
    assert torch.max(torch.abs(got - ref[-1])).item() <= TOL


@pytest.mark.parametrize("family", FAMILIES)
def test_slot_write_with_custom_mask_equals_reference(family):
    """Write tokens 4..13 at their slots over a cache holding 0..8, with a mask that hides tokens
    2 and 3 from everyone after them: the reference applies the same visibility."""
    model = make_model(family)
    adapter, device = get_adapter(model), model.device
    visible = CAUSAL.to(device, copy=True)
    visible[4:, 2:4] = False
    ref = reference_logits(model, family, IDS, GAPPED, visible)
    cache = SpliceCache(adapter.kv_spec(), len(IDS), device=device)
    adapter.forward(torch.tensor([IDS[:9]], device=device), torch.tensor([GAPPED[:9]], device=device), cache)
    slots = torch.arange(4, len(IDS), device=device)
    got = adapter.forward(torch.tensor([IDS[4:]], device=device), torch.tensor([GAPPED[4:]], device=device), cache,
                          write_slots=slots, attention_mask=visible[4:][None, None])[0]
    assert torch.max(torch.abs(got - ref[-1])).item() <= TOL
    assert torch.max(torch.abs(got - reference_logits(model, family, IDS, GAPPED, CAUSAL)[-1])).item() > 1e-3
