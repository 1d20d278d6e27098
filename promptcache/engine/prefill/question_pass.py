"""The question's attention over a prompt's reused states: what query-aware selections rank by.

A selection in ``SCORED`` (``qattn``, ``qattn_fast``, ``qattn_module``) ranks the reused (drifted)
tokens by the attention the prompt's new tokens (the question, and the separators and chat header
around it) pay them over the assembled cache: ``QuestionPass`` names which layers and which of the
new tokens' queries count. ``question_scores`` computes it with a pass that stops early:

* the new tokens run over the cache as the r=0 splice would run them, through the read layers and
  no further: the forward stops (``_Done``) in the attention of the last read layer, so a pass
  reading the first third of the layers costs about a third of an r=0 prefill of the new tokens;
* each layer's attention runs through ``NAME`` (registered with transformers' attention
  interface): the layer's output as the engine computes it (``ordered_attention``, sdpa's
  result), and in a read layer ``softmax(q . k * scaling + mask)`` of the last ``queries`` new
  tokens over every key, the cached slots' columns summed over heads and queries: [n_cached].
  No eager attention and no probabilities tensor of every layer;
* the cache is left as the pass found it (length ``n_cached``): the new tokens' states in the
  layers run were computed over the stale cache, which the recompute forward changes, so none of
  the pass's work is exact to keep.

``question_attention`` is the reference (and the path of families whose attention does not go
through transformers' interface, ALiBi's): one eager forward of every layer with hooks that
capture the probabilities. With every layer and every query, ``question_scores`` equals it
(tests/engine/test_question_pass.py).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Callable

import torch
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from ...kernels.ordered_attention import ordered_attention
from ...models.masks import BOOL_MASK_ATTENTION

__all__ = ["NAME", "QuestionPass", "question_attention", "question_scores"]

NAME = "promptcache_question"  # the attention a pass runs in (registered below)


@dataclass(frozen=True)
class QuestionPass:
    """Which attention counts: layers ``[int(L * first), round(L * stop))`` of the model's ``L``
    (at least one), and the last ``queries`` new tokens' queries (None: every new token's)."""

    first: float = 0.0
    stop: float = 1.0
    queries: int | None = None

    def __post_init__(self):
        if not 0.0 <= self.first < self.stop <= 1.0:
            raise ValueError(f"a question pass reads layers from a fraction 'first' in [0, 1) to a larger 'stop' "
                             f"<= 1, got first={self.first!r}, stop={self.stop!r}")
        if self.queries is not None and (not isinstance(self.queries, int) or self.queries < 1):
            raise ValueError(f"a question pass's 'queries' is a count >= 1 or None (every new token), "
                             f"got {self.queries!r}")

    def layers(self, n_layers: int) -> range:
        a = int(n_layers * self.first)
        return range(a, max(a + 1, min(n_layers, round(n_layers * self.stop))))


# -- the reference: eager attention in every layer --------------------------------------------------
def question_attention(adapter, run: Callable[[], object], n_cached: int) -> torch.Tensor | None:
    """Attention probabilities the new tokens pay each cached slot, summed over heads and queries,
    per layer: [L, n_cached]. ``run`` does the forward of the new tokens over the assembled cache,
    with eager attention (sdpa returns no probabilities). None when the model's attention modules
    return no probabilities (then selections fall back)."""
    got: list[torch.Tensor] = []

    def hook(_mod, _args, out):
        if isinstance(out, tuple) and len(out) > 1 and isinstance(out[1], torch.Tensor) and out[1].dim() == 4:
            got.append(out[1][..., :n_cached].float().sum(dim=(0, 1, 2)))  # [B, H, T, kv] -> [n_cached]

    mods = [m for m in adapter.model.modules() if type(m).__name__.endswith("Attention")]
    handles = [m.register_forward_hook(hook) for m in mods]
    try:
        with adapter.attention_as("eager"):
            run()
    finally:
        for h in handles:
            h.remove()
    if not got:
        return None
    return torch.stack(got)


# -- the pass that stops early --------------------------------------------------------------------
class _Done(Exception):
    """The last read layer's scores are in: the rest of the forward is not needed."""


@dataclass
class _InFlight:
    read: frozenset[int]  # layer indices whose attention counts
    last: int  # the last of them: the forward stops there
    queries: int | None
    n_cached: int
    scores: list[torch.Tensor]  # [n_cached] per read layer, in layer order


_LOCAL = threading.local()  # the pass in flight on this thread (set only inside ``question_scores``)


def _bottom_right_causal(t: int, kv: int, device) -> torch.Tensor:
    """bool [1, 1, t, kv]: query i (the i-th of the last t keys) sees keys 0 .. kv - t + i."""
    return torch.ones((t, kv), dtype=torch.bool, device=device).tril(kv - t)[None, None]


def _layer_scores(query, key, mask, scaling, softcap, queries: int | None, n_cached: int) -> torch.Tensor:
    """query [1, Hq, T, D], key [1, Hk, K, D], mask bool or additive [1, 1, T, K]: the probabilities
    the last ``queries`` rows pay the first ``n_cached`` keys, summed over heads and rows: [n_cached]."""
    m = query.shape[2] if queries is None else min(queries, query.shape[2])
    q = query[:, :, -m:].float()  # [1, Hq, m, D]
    k = key.float().repeat_interleave(query.shape[1] // key.shape[1], dim=1)  # [1, Hq, K, D]
    logits = q @ k.transpose(2, 3) * scaling  # [1, Hq, m, K]
    if softcap is not None:
        logits = torch.tanh(logits / softcap) * softcap
    rows = mask[:, :, -m:, : key.shape[2]]
    if rows.dtype == torch.bool:
        logits = logits.masked_fill(~rows, float("-inf"))
    else:
        logits = logits + rows.float()
    return torch.softmax(logits, dim=-1)[..., :n_cached].sum(dim=(0, 1, 2))


def _question_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """transformers' attention signature. The layer's output as the engine computes it; in a read
    layer also its scores (``_layer_scores``); in the last read layer nothing more (``_Done``)."""
    p: _InFlight | None = getattr(_LOCAL, "pass_", None)
    if attention_mask is None:  # the mask function skipped a plain causal mask: make it explicit
        attention_mask = _bottom_right_causal(query.shape[2], key.shape[2], query.device)
    layer = getattr(module, "layer_idx", None)
    if p is not None and layer in p.read:
        scale = float(scaling) if scaling is not None else query.shape[-1] ** -0.5
        p.scores.append(_layer_scores(query, key, attention_mask, scale, kwargs.get("softcap"), p.queries,
                                      p.n_cached))
        if layer == p.last:
            raise _Done
    return ordered_attention(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)


AttentionInterface.register(NAME, _question_attention)
AttentionMaskInterface.register(NAME, sdpa_mask)  # the model builds sdpa's bool masks for it
BOOL_MASK_ATTENTION.add(NAME)  # the adapter hands it bool masks as it does sdpa


def question_scores(adapter, cache, ids: torch.Tensor, pos: torch.Tensor, spec: QuestionPass) -> torch.Tensor | None:
    """The new tokens ``ids``/``pos`` [1, T] over ``cache`` (the prompt's cached spans at slots
    0..n_cached-1, length n_cached): the attention they pay each cached slot, summed over the
    layers and queries ``spec`` names: [n_cached] (float32). The cache keeps length n_cached.
    None where the model's attention returns nothing to read (the reference's fallback)."""
    n_cached = cache.length
    n_layers = adapter.kv_spec().layers
    layers = spec.layers(n_layers)
    if adapter.inline_attention:  # attention outside transformers' interface: the eager reference
        return _reference(adapter, cache, ids, pos, layers)
    p = _InFlight(frozenset(layers), layers[-1], spec.queries, n_cached, [])
    _LOCAL.pass_ = p
    try:
        with adapter.attention_as(NAME):
            adapter.forward(ids, pos, cache)
    except _Done:
        pass
    finally:
        _LOCAL.pass_ = None
        cache.set_length(n_cached)
    if len(p.scores) != len(layers):  # some layer's attention did not come through the interface
        return _reference(adapter, cache, ids, pos, layers)
    return torch.stack(p.scores).sum(0)


def _reference(adapter, cache, ids, pos, layers: range) -> torch.Tensor | None:
    """``question_attention`` summed over ``layers`` (every query counts: its hooks see the
    probabilities summed); the cache keeps its length."""
    n_cached = cache.length
    per_layer = question_attention(adapter, lambda: adapter.forward(ids, pos, cache), n_cached)
    cache.set_length(n_cached)
    return None if per_layer is None else per_layer[layers.start : layers.stop].sum(0)
