"""Selective recompute's mechanism: slot-addressed writes and masks through ``Adapter.forward``.

A prompt's cached spans are assembled into a ``SpliceCache`` as the engine does (definition
states placed at slots 0.. in prompt order). Recomputing ALL of its tokens through
``write_slots`` (every slot, in prompt order, causal by prompt order) must equal a plain forward
over the prompt's tokens at the layout's position IDs (issue 11: ``recompute=1.0``). Recomputing
a subset in the middle plus the new tokens must equal an independent reference: the stock model
on a ``DynamicCache`` of the kept entries with the same mask (columns in another order).
"""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from oracle import assembled_cache, plain_logits_at
from promptcache import layout_prompt, layout_schema
from promptcache.models.splice import SpliceCache
from promptcache.models import get_adapter
from tiny import FAMILIES, make_model, make_tokenizer

TOL = 1e-4

SCHEMA = """<schema name="s">
  <system>You are a travel planner.</system>
  <user>
    <module name="a">Paris is the capital of France, famous for museums.</module>
    <module name="b">Tokyo is a huge city in Japan with temples.</module>
    <module name="c">Keep it cheap. Highlight the food.</module>
    <module name="d">The quick brown fox jumps over the lazy dog.</module>
  </user>
</schema>"""

PROMPT = '<prompt schema="s"><a/> Plan a trip. <c/><d/> Answer in one short paragraph.</prompt>'


@pytest.fixture(scope="module")
def layouts():
    tok = make_tokenizer()
    schema = layout_schema(SCHEMA, tok)
    return schema, layout_prompt(PROMPT, schema, tok)


def _prompt_slots(layout, n_cached):
    """Per prompt token (prompt order): (span, slot in the assembled cache). Cached spans sit at
    slots 0.. in order, new tokens after them in order (the engine's placement)."""
    out, c, n = [], 0, n_cached
    for span in layout.spans:
        for _ in span.token_ids:
            if span.kind == "cached":
                out.append((span, c))
                c += 1
            else:
                out.append((span, n))
                n += 1
    return out


def _causal_by_order(query_idx, col_idx, device):
    """bool [1, 1, Q, K] on ``device``: query i sees column j iff j's prompt index <= i's (True = attend)."""
    q = torch.tensor(query_idx, device=device)[:, None]
    k = torch.tensor(col_idx, device=device)[None, :]
    return (k <= q)[None, None]


def _check_gapped(layout):
    pos = layout.position_ids
    assert any(b - a > 1 for a, b in zip(pos, pos[1:])), "the test prompt must have position gaps"
    assert sum(len(s) for s in layout.new) > 0 and sum(len(s) for s in layout.cached) > 20


@pytest.mark.parametrize("family", FAMILIES + ["llama:eager", "gpt2:eager", "qwen2:eager"])
def test_recompute_all_equals_plain_forward(family, layouts):
    name, _, attn = family.partition(":")
    model = make_model(name, attn=attn or None)
    device = model.device
    schema, layout = layouts
    _check_gapped(layout)
    cache, n_cached = assembled_cache(model, schema, layout)
    ids, pos = layout.token_ids, layout.position_ids
    slots = [s for _, s in _prompt_slots(layout, n_cached)]
    kv_len = len(ids)
    mask = torch.zeros(1, 1, len(ids), kv_len, dtype=torch.bool, device=device)  # causal by prompt order, at the slots
    for i in range(len(ids)):
        mask[0, 0, i, slots[: i + 1]] = True

    got = get_adapter(model).forward(torch.tensor([ids], device=device), torch.tensor([pos], device=device), cache,
                                     write_slots=torch.tensor(slots, device=device), attention_mask=mask)[0]
    ref = plain_logits_at(model, ids, pos)
    assert cache.length == kv_len
    assert torch.equal(cache.positions[0, slots], torch.tensor(pos, device=device))
    assert torch.max(torch.abs(got - ref)).item() <= TOL
    assert not cache.resident, "rewritten residents must be forgotten"

    # the cache now holds a plain prefill's states: one more token decodes like the plain forward
    nxt = int(torch.argmax(ref))
    nxt_ids, nxt_pos = torch.tensor([[nxt]], device=device), torch.tensor([[pos[-1] + 1]], device=device)
    step = get_adapter(model).forward(nxt_ids, nxt_pos, cache)[0]
    assert torch.max(torch.abs(step - plain_logits_at(model, ids + [nxt], pos + [pos[-1] + 1]))).item() <= TOL


@pytest.mark.parametrize("family", FAMILIES)
def test_default_mask_of_a_full_rewrite_is_causal_by_order(family, layouts):
    model = make_model(family)
    device = model.device
    schema, layout = layouts
    cache, n_cached = assembled_cache(model, schema, layout)
    ids, pos = layout.token_ids, layout.position_ids
    slots = [s for _, s in _prompt_slots(layout, n_cached)]
    got = get_adapter(model).forward(torch.tensor([ids], device=device), torch.tensor([pos], device=device), cache,
                                     write_slots=torch.tensor(slots, device=device))
    assert torch.max(torch.abs(got[0] - plain_logits_at(model, ids, pos))).item() <= TOL


@pytest.mark.parametrize("family", FAMILIES + ["llama:eager"])
def test_partial_recompute_equals_reference(family, layouts):
    """Recompute module ``c`` (in the middle) and every new token; the kept entries stay."""
    name, _, attn = family.partition(":")
    model = make_model(name, attn=attn or None)
    adapter, device = get_adapter(model), model.device
    schema, layout = layouts
    cache, n_cached = assembled_cache(model, schema, layout)
    toks = [(i, span, slot, t, p) for i, ((span, slot), t, p)
            in enumerate(zip(_prompt_slots(layout, n_cached), layout.token_ids, layout.position_ids))]
    redo = [x for x in toks if x[1].kind == "new" or x[1].name == "c"]
    kept = [x for x in toks if x not in redo]  # in slot order (cached spans are placed in prompt order)
    assert redo[0][0] < kept[-1][0] and len(redo) < len(toks), "the subset must be in the middle"
    kept_slots = [x[2] for x in kept]
    kv_len = n_cached + sum(len(s) for s in layout.new)
    slot_idx = [None] * kv_len  # prompt index of the token at each slot
    for i, _, slot, _, _ in toks:
        slot_idx[slot] = i
    mask = _causal_by_order([x[0] for x in redo], slot_idx, device)
    spec = adapter.kv_spec()
    kept_kv = cache.buf[:, :, 0, :, kept_slots].clone()  # [L, 2, H, n_kept, D] before the rewrite

    ids_q = torch.tensor([[x[3] for x in redo]], device=device)
    pos_q = torch.tensor([[x[4] for x in redo]], device=device)
    got = adapter.forward(ids_q, pos_q, cache, write_slots=torch.tensor([x[2] for x in redo], device=device),
                          attention_mask=mask)[0]
    assert torch.equal(cache.buf[:, :, 0, :, kept_slots], kept_kv), "kept entries must not change"

    # reference: the kept entries first, then the recomputed tokens appended, same visibility
    ref_mask = _causal_by_order([x[0] for x in redo], [x[0] for x in kept] + [x[0] for x in redo], device)
    if adapter.positional == "alibi":  # no stock way to take gapped positions: the append path
        ref_cache = SpliceCache(spec, kv_len, device=device)
        ref_cache.write(0, kept_kv, torch.tensor([x[4] for x in kept], device=device))
        ref_cache.set_length(len(kept))
        ref = adapter.forward(ids_q, pos_q, ref_cache, attention_mask=ref_mask)[0]
        ref_states = ref_cache.buf[:, :, 0, :, len(kept) : kv_len]
    else:  # the stock model on a DynamicCache, with an additive 4D mask
        past = DynamicCache(ddp_cache_data=[(kept_kv[l, 0][None], kept_kv[l, 1][None]) for l in range(spec.layers)])
        additive = torch.zeros(ref_mask.shape, device=device).masked_fill_(~ref_mask, torch.finfo(torch.float32).min)
        with torch.inference_mode():
            out = model(input_ids=ids_q, position_ids=pos_q, past_key_values=past, attention_mask=additive,
                        use_cache=True)
        ref = out.logits[0, -1]
        ref_states = torch.stack([torch.stack([out.past_key_values.layers[l].keys[0, :, len(kept):],
                                               out.past_key_values.layers[l].values[0, :, len(kept):]])
                                  for l in range(spec.layers)])
    assert torch.max(torch.abs(got - ref)).item() <= TOL
    ours = cache.buf[:, :, 0, :, [x[2] for x in redo]]
    assert torch.max(torch.abs(ours - ref_states)).item() <= TOL
    # kept ``d`` was encoded after ``b``, which the prompt skips: a partial recompute is not a plain prefill
    assert torch.max(torch.abs(got - plain_logits_at(model, layout.token_ids, layout.position_ids))).item() > TOL
