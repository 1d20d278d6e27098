"""The test oracle (DESIGN.md section 4), computed directly with the model.

Rotary and learned-position models run the stock forward with ``position_ids`` (an empty
``DynamicCache`` is passed so transformers never mistakes gaps for packed sequences). ALiBi
models have no stock way to take position IDs with gaps, so their oracle runs through the
adapter's forward; the adapter itself is checked against the stock forward in
``test_engine_exact.py`` (contiguous positions) and for translation invariance.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache

from promptcache.models.splice import SpliceCache
from promptcache.engine.prefill.plan import Segment
from promptcache.models import get_adapter


def _run(model, ids, pos, past):
    """Run tokens at positions on top of `past`; returns (last logits [V], past)."""
    adapter = get_adapter(model)
    device = model.device
    ids_t = torch.tensor([ids], dtype=torch.long, device=device)
    pos_t = torch.tensor([pos], dtype=torch.long, device=device)
    if adapter.positional == "alibi":
        return adapter.forward(ids_t, pos_t, past)[0], past
    extra = {}
    if adapter.windows_by_position:  # Gemma 3: each layer type's mask, its window measured in position IDs
        extra["attention_mask"] = windowed_masks(model.config, past.pc_positions, pos, device)
        past.pc_positions = past.pc_positions + list(pos)
    with torch.inference_mode():
        out = model(input_ids=ids_t, position_ids=pos_t, past_key_values=past, use_cache=True, **extra)
    return out.logits[0, -1], out.past_key_values


def windowed_masks(config, past_pos, pos, device):
    """The stock model's attention masks by layer type (bool [1, 1, T, kv], True = attend) for
    tokens at ``pos`` after keys at ``past_pos``: every earlier key and the new ones causally; in
    sliding layers only keys at positions above the query's minus ``config.sliding_window``
    (transformers' ``kv_idx > q_idx - window``, here in position IDs, not cache indices)."""
    keys = torch.tensor(list(past_pos) + list(pos), device=device)
    q = torch.tensor(list(pos), device=device)
    seen = torch.ones((len(q), len(keys)), dtype=torch.bool, device=device)
    seen[:, len(past_pos):] = torch.ones((len(q), len(q)), dtype=torch.bool, device=device).tril()
    inside = keys[None, :] > q[:, None] - config.sliding_window
    return {"full_attention": seen[None, None], "sliding_attention": (seen & inside)[None, None]}


def _empty(model, capacity=4096):
    adapter = get_adapter(model)
    if adapter.positional == "alibi":
        return SpliceCache(adapter.kv_spec(), capacity, device=model.device)
    past = DynamicCache()
    past.pc_positions = []  # the position IDs of its entries (read by windowed_masks)
    return past


def _layer_kv(past, layer):
    if isinstance(past, SpliceCache):
        return past.buf[layer, 0, :, :, : past.length], past.buf[layer, 1, :, :, : past.length]
    return past.layers[layer].keys, past.layers[layer].values


def context_spans(schema_layout, span_index):
    """The schema spans a stored span is encoded after (its pass), the span itself last."""
    span = schema_layout.spans[span_index]
    assign = {u.index: u.scaffold for u in schema_layout.unions.values()}
    assign.update(dict(span.choices))
    return [s for s in schema_layout.spans[: span_index + 1] if all(assign[u] == m for u, m in s.choices)]


def definition_state(model, schema_layout, prompt_layout):
    """Keep exactly the imported spans' entries from their encoding contexts, then run the new
    tokens on top. Returns (logits [V], past, next position)."""
    n_layers = get_adapter(model).kv_spec().layers
    keys = [[] for _ in range(n_layers)]
    values = [[] for _ in range(n_layers)]
    positions = []
    cached = list(prompt_layout.cached)
    new = [(t, p) for s in prompt_layout.new for t, p in zip(s.token_ids, s.position_ids)]
    if not new:  # the engine recomputes the last cached token
        last = cached[-1]
        new = [(last.token_ids[-1], last.position_ids[-1])]
    for span in cached:
        ctx = context_spans(schema_layout, span.schema_index)
        ids = [t for s in ctx for t in s.token_ids]
        pos = [p for s in ctx for p in range(s.start, s.end)]
        _, past = _run(model, ids, pos, _empty(model))
        n = len(span.token_ids)
        if span is cached[-1] and new[0] == (span.token_ids[-1], span.position_ids[-1]) and not prompt_layout.new:
            n -= 1
        for layer in range(n_layers):
            k, v = _layer_kv(past, layer)
            keys[layer].append(k[:, :, len(ids) - len(span.token_ids) : len(ids) - len(span.token_ids) + n])
            values[layer].append(v[:, :, len(ids) - len(span.token_ids) : len(ids) - len(span.token_ids) + n])
        positions += list(span.position_ids[:n])
    past = _empty(model)
    if cached:
        kv = [(torch.cat(keys[l], 2), torch.cat(values[l], 2)) for l in range(n_layers)]
        if isinstance(past, SpliceCache):
            n = kv[0][0].shape[2]
            for l, (k, v) in enumerate(kv):
                past.buf[l, 0, :, :, :n] = k
                past.buf[l, 1, :, :, :n] = v
            past.positions[0, :n] = torch.tensor(positions)
            past.set_length(n)
        else:
            past = DynamicCache(ddp_cache_data=kv)
            past.pc_positions = list(positions)
    ids = [t for t, _ in new]
    pos = [p for _, p in new]
    logits, past = _run(model, ids, pos, past)
    all_pos = [p for s in prompt_layout.spans for p in s.position_ids]
    return logits, past, max(all_pos) + 1


def definition_greedy(model, schema_layout, prompt_layout, n_tokens, eos=None):
    logits, past, pos = definition_state(model, schema_layout, prompt_layout)
    out = []
    for i in range(n_tokens):
        tok = int(torch.argmax(logits))
        out.append(tok)
        if tok == eos or i == n_tokens - 1:
            break
        logits, past = _run(model, [tok], [pos], past)
        pos += 1
    return out


def plain_logits(model, token_ids):
    """One stock forward pass over token ids at positions 0..n-1: last-token logits."""
    with torch.inference_mode():
        out = model(input_ids=torch.tensor([token_ids], dtype=torch.long, device=model.device))
    return out.logits[0, -1]


def plain_logits_at(model, token_ids, position_ids):
    """One forward over ``token_ids`` at ``position_ids`` from an empty cache: last logits [V].
    Rotary and learned models: the stock forward with ``position_ids``; ALiBi models: the adapter's
    hot path (checked against an independent bias in ``tests/engine/test_alibi_reference.py``)."""
    return _run(model, list(token_ids), list(position_ids), _empty(model))[0]


def assembled_cache(model, schema_layout, prompt_layout, room=64):
    """The cache the engine assembles for a prompt: every cached span's entries from its encoding
    context (the definition, DESIGN.md section 4), placed at slots 0.. in prompt order
    (``SpliceCache.place``), with ``room`` free slots after them. Returns (cache, n_cached)."""
    adapter = get_adapter(model)
    n_layers = adapter.kv_spec().layers
    placed = []
    for i, span in enumerate(prompt_layout.cached):
        ctx = context_spans(schema_layout, span.schema_index)
        ids = [t for s in ctx for t in s.token_ids]
        pos = [p for s in ctx for p in range(s.start, s.end)]
        _, past = _run(model, ids, pos, _empty(model))
        lo, hi = len(ids) - len(span.token_ids), len(ids)
        kv = torch.stack([torch.stack([_layer_kv(past, l)[0][0, :, lo:hi], _layer_kv(past, l)[1][0, :, lo:hi]])
                          for l in range(n_layers)])  # [L, 2, H, n, D]
        placed.append(Segment(str(i), kv, torch.tensor(span.position_ids)))
    n_cached = sum(len(s) for s in prompt_layout.cached)
    cache = SpliceCache(adapter.kv_spec(), n_cached + room, device=model.device)
    cache.place(placed)
    return cache, n_cached
