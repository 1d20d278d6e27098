"""Masked forwards whose mask is causal in some order of the keys, on the native CPU kernel.

Selective recompute (``engine/prefill/recompute.py``) runs one forward with a mask causal by
prompt order: query i sees every slot whose token comes at or before it in the prompt. Its buffer
holds the cached spans, then the new tokens (a chat header, separators between documents, the
question), so in slot order the mask is ragged; with the keys put in prompt order it is a prefix
per query: query i sees keys 0 .. limit_i - 1. torch's SDPA with a mask scores every query
against every key and masks afterwards; on the 4-document RAG prompt that was ~0.19 s of a
~0.75 s time to first token, where on average half the keys are masked. Here the keys are
reordered (``key_order``: by how many queries see each, which for such a mask is prompt order
up to the order of keys no query tells apart; one copy of a layer's keys and values, skipped when
slot order already is it) and the native
kernel's ``attend_limits`` (``kernels/attention.cpp``) reads only the key tiles each query tile
sees. Softmax does not depend on the keys' order: the result is the masked attention's.

``ordered_attention`` is registered with transformers' ``AttentionInterface`` as ``NAME``; the
adapter's masked forward (``Adapter.masked_attention``) switches a model whose attention is
"sdpa" to it for that forward only. It computes what transformers' sdpa function computes (the
same mask, float32 sums; a bfloat16 model's queries over bfloat16 keys in bfloat16 products, as
the paged engine's kernel); anything the kernel does not cover runs transformers' sdpa function
unchanged: a mask that is not a prefix per query, a batch of several, another device or dtype or
head dim, dropout, softcapping, attention sinks.
"""

from __future__ import annotations

import threading

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from . import attention as native

__all__ = ["NAME", "covers", "key_order", "ordered_attention"]

NAME = "promptcache_ordered"

_LOCAL = threading.local()  # (mask, its key_order, limits per query head group): once a forward, not once a layer


def covers(device: torch.device) -> bool:
    """Whether a masked forward on ``device`` can take the native kernel (the CPU, the kernel built)."""
    return torch.device(device).type == "cpu" and native.available()


def key_order(mask: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor] | None:
    """For a bool mask [1, 1, T, K] (True = attend): (order, limits) such that query i sees exactly
    the keys order[0 .. limits[i] - 1] (``order`` int64: the keys some query sees, max(limits) of
    them; None where slot order already is it; limits int64 [T], each >= 1), or None when no order
    of the keys makes every query's keys a prefix. Keys seen by more queries come first (a stable
    sort: ties keep slot order). Worked out once a forward: every layer reads the same order."""
    rows = mask[0, 0]
    limits = rows.sum(-1)
    if not bool((limits > 0).all()):
        return None
    order = torch.argsort(rows.sum(0), descending=True, stable=True)
    slot_order = torch.arange(rows.shape[-1], device=rows.device)
    if torch.equal(order, slot_order):
        order, ordered = None, rows
    else:
        ordered = rows.index_select(1, order)
    if not torch.equal(ordered, slot_order[None, :] < limits[:, None]):
        return None
    return (None if order is None else order[: int(limits.max())]), limits


def _key_order(mask: torch.Tensor, g: int):
    """``key_order(mask)`` with its limits repeated for ``g`` query heads a KV head (the kernel's
    rows), or None; every layer of a forward is handed the same mask, so this runs once a forward."""
    memo = getattr(_LOCAL, "memo", None)
    if memo is None or memo[0] is not mask or memo[1] != g:
        found = key_order(mask)
        _LOCAL.memo = memo = (mask, g, None if found is None else (found[0], found[1].repeat(g)))
    return memo[2]


def _native(query, key, value, mask, dropout, scaling, kwargs) -> torch.Tensor | None:
    """The attention output [1, T, Hq, D] from the native kernel, or None where it does not apply."""
    if (mask is None or mask.dtype != torch.bool or mask.dim() != 4 or query.shape[0] != 1 or mask.shape[0] != 1
            or tuple(mask.shape[2:]) != (query.shape[2], key.shape[2]) or dropout
            or kwargs.get("softcap") is not None or kwargs.get("s_aux") is not None
            or query.shape[1] % key.shape[1]):
        return None
    op = native.limits_kernel_for(query[0], key[0])
    if op is None or value.dtype != key.dtype:
        return None
    _, hq, t, d = query.shape
    hk = key.shape[1]
    g = hq // hk
    found = _key_order(mask, g)
    if found is None:
        return None
    order, limits = found
    k, v = key[0], value[0]  # [Hk, K, D]
    if order is not None:  # the keys any query sees, in prompt order (one copy)
        k, v = k.index_select(1, order), v.index_select(1, order)
    q = query[0].contiguous().view(hk, g * t, d)  # kv head x serves query heads x*g .. x*g+g-1, T rows each
    scale = float(scaling) if scaling is not None else d ** -0.5
    out, _ = op(q, k, v, scale, limits)
    return out.view(hq, t, d).transpose(0, 1).unsqueeze(0).to(query.dtype)  # [1, T, Hq, D]


def ordered_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """transformers' attention signature: query [1, Hq, T, D], key/value [1, Hk, K, D], mask bool
    [1, 1, T, K]. Returns (output [1, T, Hq, D], None)."""
    out = _native(query, key, value, attention_mask, dropout, scaling, kwargs)
    if out is not None:
        return out, None
    return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                  **kwargs)


AttentionInterface.register(NAME, ordered_attention)
