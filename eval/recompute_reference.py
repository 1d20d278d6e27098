"""Reference selective recompute on a stock Hugging Face model (outside the engine): the
Llama family (SmolLM2) and Gemma 3 (``gemma3_text``).

The prompt is ``prefix + module_1 + ... + module_m + suffix`` as token IDs at contiguous
positions ``0..N-1`` (no gap before the suffix). States:

* ``independent_kv``: every module encoded alone after the prefix at its final positions (the
  paper's union/RAG setting): a module's tokens attend to the prefix and to themselves only.
* ``blend``: the suffix (always new) and a selected set of cached module tokens are computed
  afresh, layer by layer, with full causal attention over everything before them in prompt order;
  at each layer a key/value slot holds the fresh state where the token is recomputed, else the
  cached (independent) one. ``recompute`` = the whole prompt is exactly a plain forward (checked
  by ``check_exact``). A selection may narrow its set after a layer (CacheBlend proper).

Layers are run by hand (``run_layers``): per layer RMSNorm, q/k/v (and their RMSNorm where the
family has one: Gemma 3, Qwen3), RoPE at the given positions with the layer's own frequencies
(the engine's adapter: ``RopeSpec.inv_freq``, one base per layer type on Gemma 3), attention over
the slot-merged keys with an explicit boolean mask (and the layer's sliding window, by position),
o_proj, MLP (Gemma's norms around attention and MLP where the layer has them). Shapes: one
sequence, keys ``[1, kv_heads, N, head_dim]`` per layer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb, repeat_kv

from promptcache.models import get_adapter

KV = list[tuple[torch.Tensor, torch.Tensor]]  # per layer (K, V), each [1, kv_heads, N, head_dim]
# narrow(layer, active [A], fresh (K, V) of the active slots at this layer) -> keep mask [A] (bool)
Narrow = Callable[[int, torch.Tensor, tuple[torch.Tensor, torch.Tensor]], torch.Tensor]


@dataclass
class Prompt:
    """Token IDs [N] and the module spans: ``modules[i] = (start, end)``, half-open, in order;
    ``[0, modules[0][0])`` is the prefix, ``[modules[-1][1], N - forced)`` the suffix (the new
    text a selection may look at), the last ``forced`` tokens a teacher-forced answer (scored, never
    seen by a selection)."""
    ids: torch.Tensor
    modules: list[tuple[int, int]]
    forced: int = 0
    target: int | None = None  # index in ``modules`` of the module holding the answer (oracle diagnostics only)

    @property
    def n(self) -> int:
        return int(self.ids.numel())

    @property
    def suffix(self) -> torch.Tensor:
        return torch.arange(self.modules[-1][1], self.n - self.forced)

    @property
    def new(self) -> torch.Tensor:
        """The suffix and the forced answer: every slot after the last module."""
        return torch.arange(self.modules[-1][1], self.n)

    @property
    def candidates(self) -> torch.Tensor:
        """Indices [C] of the cached module tokens (the tokens a selection chooses from)."""
        return torch.cat([torch.arange(s, e) for s, e in self.modules])


def causal_mask(n: int) -> torch.Tensor:
    """[N, N] bool, True where query i may attend to key j (j <= i)."""
    return torch.ones(n, n, dtype=torch.bool).tril()


def independent_mask(p: Prompt) -> torch.Tensor:
    """[N, N] bool: prefix causal; module tokens see the prefix and their own module; suffix causal."""
    m = causal_mask(p.n)
    start = p.modules[0][0]
    for s, e in p.modules:
        m[s:e, start:s] = False
    return m


@torch.no_grad()
def run_layers(model, ids: torch.Tensor, pos: torch.Tensor, mask: torch.Tensor, active: torch.Tensor,
               base: KV | None = None, narrow: Narrow | None = None, attn_out: list | None = None,
               last: int = 1):
    """Compute the states of the ``active`` slots (ascending indices [A] into ``ids`` [N]).

    ``base``: the other slots' K/V per layer (needed unless every slot is active). ``mask`` [N, N]
    bool (query row, key column). ``attn_out``: if a list, gets per layer the attention
    probabilities of the active queries that reach the last layer's hidden output [1, H, A, N].
    Returns (logits of the last ``last`` active slots [last, V], K/V per layer for all N slots,
    final active).
    """
    lm = model.model
    n = ids.numel()
    h = lm.embed_tokens(ids[active])[None]  # [1, A, D] (Gemma's embedding scales its own output)
    ropes, windows = _layer_ropes(model), get_adapter(model).sliding_windows() or [None] * len(lm.layers)
    cos_sin = {id(f): _cos_sin(f, pos[active], h.dtype) for f in {id(f): f for f in ropes}.values()}
    kv: KV = []
    for li, layer in enumerate(lm.layers):
        at = layer.self_attn
        cos, sin = cos_sin[id(ropes[li])]
        x = layer.input_layernorm(h)
        shape = (1, x.shape[1], -1, at.head_dim)
        q = at.q_proj(x).view(shape).transpose(1, 2)
        k = at.k_proj(x).view(shape).transpose(1, 2)
        v = at.v_proj(x).view(shape).transpose(1, 2)
        if hasattr(at, "q_norm"):  # Gemma 3, Qwen3: q and k RMS-normalised per head before RoPE
            q, k = at.q_norm(q), at.k_norm(k)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        if base is None:
            assert active.numel() == n, "without base states every slot must be active"
            K, V = k, v
        else:
            K, V = base[li][0].clone(), base[li][1].clone()
            K[:, :, active], V[:, :, active] = k, v
        kv.append((K, V))
        seen = mask[active]
        if windows[li] is not None:  # a sliding layer: keys at positions <= query - window are hidden
            seen = seen & (pos[active][:, None] - pos[None, :] < windows[li])
        scores = torch.matmul(q, repeat_kv(K, at.num_key_value_groups).transpose(2, 3)) * at.scaling
        scores = scores.masked_fill(~seen[None, None], float("-inf"))
        probs = torch.softmax(scores.float(), dim=-1).to(q.dtype)  # [1, H, A, N]
        if attn_out is not None:
            attn_out.append(probs)
        o = at.o_proj(torch.matmul(probs, repeat_kv(V, at.num_key_value_groups)).transpose(1, 2).reshape(1, x.shape[1], -1))
        if hasattr(layer, "pre_feedforward_layernorm"):  # Gemma: norms after attention and around the MLP
            h = h + layer.post_attention_layernorm(o)
            h = h + layer.post_feedforward_layernorm(layer.mlp(layer.pre_feedforward_layernorm(h)))
        else:
            h = h + o
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        if narrow is not None and li < len(lm.layers) - 1:
            keep = narrow(li, active, (k, v))
            if not bool(keep.all()):
                h, active = h[:, keep], active[keep]
                cos_sin = {f: (c[:, keep], s_[:, keep]) for f, (c, s_) in cos_sin.items()}
                if attn_out is not None:
                    attn_out.clear()
    logits = model.lm_head(lm.norm(h[0, -last:]))
    cap = getattr(model.config, "final_logit_softcapping", None)
    if cap:  # Gemma: logits soft-capped by the model's head
        logits = torch.tanh(logits / cap) * cap
    return logits, kv, active


def _layer_ropes(model) -> list[torch.Tensor]:
    """Each layer's rotary frequencies [head_dim // 2] (float32, as the model computes them): the
    adapter's ``RopeSpec`` (one row a layer where layer types have their own base)."""
    spec = get_adapter(model).rope_spec()
    head_dim = model.model.layers[0].self_attn.head_dim
    if spec.rotary_dim != head_dim:
        raise NotImplementedError(f"the reference rotates whole heads; this model rotates {spec.rotary_dim} of "
                                  f"{head_dim} channels")
    rows = spec.inv_freq.float()
    if rows.dim() == 1:
        return [rows] * len(model.model.layers)
    distinct = {}  # one tensor per distinct row, so cos/sin are computed once a layer type
    return [distinct.setdefault(tuple(r.tolist()), r) for r in rows]


def _cos_sin(inv_freq: torch.Tensor, pos: torch.Tensor, dtype: torch.dtype):
    """cos, sin [1, A, head_dim] at positions ``pos`` [A], as the models' rotary modules compute them."""
    freqs = (inv_freq[None, :, None].float() @ pos[None, None, :].float()).transpose(1, 2)  # [1, A, d/2]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def from_layout(layout) -> Prompt:
    """A reference prompt from an engine ``PromptLayout``: its module spans (``source == "module"``:
    PML modules, stored documents) as the modules, everything before the first the prefix, the rest
    the suffix; contiguous positions."""
    ids, mods, at = [], [], 0
    for s in layout.spans:
        if s.kind == "cached" and s.source == "module":
            mods.append((at, at + len(s)))
        ids += s.token_ids
        at += len(s)
    return Prompt(torch.tensor(ids), mods)


def independent_kv(model, p: Prompt) -> KV:
    """Naive reuse state: every module encoded alone after the prefix, at its final positions."""
    pos = torch.arange(p.n)
    _, kv, _ = run_layers(model, p.ids, pos, independent_mask(p), torch.arange(p.n))
    return kv


def blend(model, p: Prompt, base: KV, recompute: torch.Tensor, narrow: Narrow | None = None,
          attn_out: list | None = None):
    """Recompute the cached slots ``recompute`` [R] and run the new slots on top (full causal
    attention in prompt order). Returns (logits of the suffix's last slot and the forced answer's
    slots [1 + forced, V], K/V per layer [N slots])."""
    active = torch.unique(torch.cat([recompute.long(), p.new]))  # sorted
    logits, kv, _ = run_layers(model, p.ids, torch.arange(p.n), causal_mask(p.n), active, base, narrow, attn_out,
                               last=1 + p.forced)
    return logits, kv


@torch.no_grad()
def greedy(model, logits: torch.Tensor, kv: KV, n: int, max_new_tokens: int, eos: set[int]) -> list[int]:
    """Greedy continuation from first-token ``logits`` over the prompt's K/V (``n`` slots)."""
    out = []
    tok = int(logits[-1].argmax())
    ids = torch.zeros(n, dtype=torch.long)
    for step in range(max_new_tokens):
        out.append(tok)
        if tok in eos or step == max_new_tokens - 1:
            break
        m = n + step + 1
        ids = torch.cat([ids, torch.tensor([tok])])
        kv = [(torch.cat([K, K[:, :, :1] * 0], 2), torch.cat([V, V[:, :, :1] * 0], 2)) for K, V in kv]
        logits, kv, _ = run_layers(model, ids, torch.arange(m), causal_mask(m), torch.tensor([m - 1]), kv)
        tok = int(logits[-1].argmax())
    return out


def check_exact(model, p: Prompt, tol: float = 1e-4) -> float:
    """Max |logit difference| of ``blend`` with every cached slot recomputed against a plain HF
    forward of the same tokens; raises AssertionError above ``tol``."""
    base = independent_kv(model, p)
    logits, _ = blend(model, p, base, p.candidates)
    with torch.no_grad():
        ref = model(p.ids[None]).logits[0, p.n - 1 - p.forced:]
    err = float((logits - ref).abs().max())
    assert err <= tol, f"recompute=1.0 differs from a plain forward by {err:.2e} > {tol:.0e}"
    return err
