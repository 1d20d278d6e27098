"""Reference selective recompute on a stock Hugging Face Llama-family model (outside the engine).

The prompt is ``prefix + module_1 + ... + module_m + suffix`` as token IDs at contiguous
positions ``0..N-1`` (no gap before the suffix). States:

* ``independent_kv``: every module encoded alone after the prefix at its final positions (the
  paper's union/RAG setting): a module's tokens attend to the prefix and to themselves only.
* ``blend``: the suffix (always new) and a selected set of cached module tokens are computed
  afresh, layer by layer, with full causal attention over everything before them in prompt order;
  at each layer a key/value slot holds the fresh state where the token is recomputed, else the
  cached (independent) one. ``recompute`` = the whole prompt is exactly a plain forward (checked
  by ``check_exact``). A selection may narrow its set after a layer (CacheBlend proper).

Layers are run by hand (``run_layers``): per layer RMSNorm, q/k/v, RoPE at the given positions,
attention over the slot-merged keys with an explicit boolean mask, o_proj, MLP. Shapes: one
sequence, keys ``[1, kv_heads, N, head_dim]`` per layer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb, repeat_kv

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
    h = lm.embed_tokens(ids[active])[None]  # [1, A, D]
    cos, sin = lm.rotary_emb(h, pos[active][None])
    kv: KV = []
    for li, layer in enumerate(lm.layers):
        at = layer.self_attn
        x = layer.input_layernorm(h)
        shape = (1, x.shape[1], -1, at.head_dim)
        q = at.q_proj(x).view(shape).transpose(1, 2)
        k = at.k_proj(x).view(shape).transpose(1, 2)
        v = at.v_proj(x).view(shape).transpose(1, 2)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        if base is None:
            assert active.numel() == n, "without base states every slot must be active"
            K, V = k, v
        else:
            K, V = base[li][0].clone(), base[li][1].clone()
            K[:, :, active], V[:, :, active] = k, v
        kv.append((K, V))
        scores = torch.matmul(q, repeat_kv(K, at.num_key_value_groups).transpose(2, 3)) * at.scaling
        scores = scores.masked_fill(~mask[active][None, None], float("-inf"))
        probs = torch.softmax(scores.float(), dim=-1).to(q.dtype)  # [1, H, A, N]
        if attn_out is not None:
            attn_out.append(probs)
        o = torch.matmul(probs, repeat_kv(V, at.num_key_value_groups)).transpose(1, 2).reshape(1, x.shape[1], -1)
        h = h + at.o_proj(o)
        h = h + layer.mlp(layer.post_attention_layernorm(h))
        if narrow is not None and li < len(lm.layers) - 1:
            keep = narrow(li, active, (k, v))
            if not bool(keep.all()):
                h, active = h[:, keep], active[keep]
                cos, sin = cos[:, keep], sin[:, keep]
                if attn_out is not None:
                    attn_out.clear()
    logits = model.lm_head(lm.norm(h[0, -last:]))
    return logits, kv, active


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
