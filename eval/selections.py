"""Recompute selections for ``recompute_reference.blend``: which cached module tokens to compute afresh.

Every selection takes (model, prompt, base K/V, budget) and returns (indices [R] of the slots to
recompute, a per-layer ``narrow`` or None, extra tokens run through the model for scoring). The
budget is a count of module tokens: ``round(recompute * C)`` of the ``C`` cached module tokens.
Ties in a ranking are broken by the earlier slot (stable sort on descending score).
"""

from __future__ import annotations

import torch

from . import engine_selections  # noqa: F401 (registers qattn_mix and qmatch_later with the engine)
from .recompute_reference import KV, Prompt, blend, causal_mask, run_layers


def _top(scores: torch.Tensor, cand: torch.Tensor, k: int) -> torch.Tensor:
    """The ``k`` candidates [C] with the highest scores [C], earlier slot first among equals."""
    order = torch.sort(scores, descending=True, stable=True).indices[:k]
    return cand[order].sort().values


def question_attention(model, p: Prompt, base: KV, layers: slice = slice(None), last: int | None = None):
    """Attention the suffix's queries pay each candidate over the reused (independent) state [C]:
    probabilities summed over heads, the chosen layers and suffix tokens (the last ``last`` only
    when given). Costs one pass of the suffix tokens."""
    attn: list[torch.Tensor] = []
    blend(model, p, base, torch.empty(0, dtype=torch.long), attn_out=attn)
    a = torch.stack(attn[layers])[..., : p.suffix.numel(), :]  # [L, 1, H, S, N]: the question's queries
    if last is not None:
        a = a[..., -last:, :]
    return a.sum(dim=(0, 1, 2, 3))[p.candidates]


def none(model, p, base, budget):
    return torch.empty(0, dtype=torch.long), None, 0


def epic(model, p, base, budget):
    """EPIC / LegoLink: the first k tokens of every module, k = budget / modules."""
    k = budget // len(p.modules)
    sel = [torch.arange(s, min(e, s + k)) for s, e in p.modules]
    return torch.cat(sel) if sel else torch.empty(0, dtype=torch.long), None, 0


def tail(model, p, base, budget):
    """The last ``budget`` module tokens: the modules before them stay reused, the rest is exact
    given them (a prefix-shaped reuse)."""
    return p.candidates[p.candidates.numel() - budget:] if budget else torch.empty(0, dtype=torch.long), None, 0


def cacheblend(model, p, base, budget, layer: int = 1):
    """CacheBlend-style: every module token is computed afresh through ``layer``; after it the
    ``budget`` tokens with the largest K+V deviation from the cached state (L2 over heads) go on."""
    cand = set(p.candidates.tolist())

    def narrow(li, active, fresh):
        if li != layer:
            return torch.ones(active.numel(), dtype=torch.bool)
        k, v = fresh
        dev = ((k - base[li][0][:, :, active]).norm(dim=-1) + (v - base[li][1][:, :, active]).norm(dim=-1)).sum((0, 1))
        is_cand = torch.tensor([int(a) in cand for a in active])
        dev = torch.where(is_cand, dev, torch.full_like(dev, -1.0))
        keep = ~is_cand
        order = torch.sort(dev, descending=True, stable=True).indices[:budget]
        keep[order] = True
        return keep
    return p.candidates, narrow, 0


def qattn(model, p, base, budget, layers=slice(None), last=None):
    """A3 / ProphetKV-like: the tokens the question attends to most over the reused state."""
    s = question_attention(model, p, base, layers, last)
    return _top(s, p.candidates, budget), None, p.suffix.numel()


def qattn_bound(model, p, base, budget, k: int = 2):
    """``qattn`` plus the first ``k`` tokens of every module after the first (boundaries)."""
    bound = torch.cat([torch.arange(s, min(e, s + k)) for s, e in p.modules[1:]]) if len(p.modules) > 1 \
        else torch.empty(0, dtype=torch.long)
    bound = bound[: budget]
    s = question_attention(model, p, base)
    s[torch.isin(p.candidates, bound)] = float("inf")
    return _top(s, p.candidates, budget), None, p.suffix.numel()


def qattn_module(model, p, base, budget):
    """Whole modules ranked by the question's attention mass (the module's mean per token); the
    budget fills modules in rank order, the last one partly (its first tokens)."""
    s = question_attention(model, p, base)
    cand = p.candidates
    mass = []
    for s0, e0 in p.modules:
        sel = (cand >= s0) & (cand < e0)
        mass.append(float(s[sel].mean()))
    out, left = [], budget
    for i in sorted(range(len(mass)), key=lambda i: (-mass[i], i)):
        if left <= 0:
            break
        s0, e0 = p.modules[i]
        take = min(left, e0 - s0)
        out.append(torch.arange(s0, s0 + take))
        left -= take
    return (torch.cat(out).sort().values if out else torch.empty(0, dtype=torch.long)), None, p.suffix.numel()


def qattn_iter(model, p, base, budget, rounds: int = 2):
    """``qattn`` in ``rounds`` steps: recompute the top half of the budget, re-run the question over
    the blended state, rank again and fill the rest."""
    cand = p.candidates
    s = question_attention(model, p, base)
    first = _top(s, cand, budget // 2)
    attn: list[torch.Tensor] = []
    _, kv = blend(model, p, base, first, attn_out=None)
    # the question over the partly recomputed state: rank the remaining candidates
    run_layers(model, p.ids, torch.arange(p.n), causal_mask(p.n), p.suffix, kv, attn_out=attn)  # forced slots unseen
    s2 = torch.stack(attn).sum(dim=(0, 1, 2, 3))[cand]
    s2[torch.isin(cand, first)] = float("inf")
    return _top(s2, cand, budget), None, 2 * (p.suffix.numel()) + first.numel()


def whole_notes(p, order: list[int], budget: int, sink: int = 0) -> torch.Tensor:
    """The first ``sink`` tokens of every module, then whole modules in ``order`` while they fit,
    then the first tokens of the next one (the budget is always spent, never exceeded)."""
    out = [torch.arange(s, min(e, s + sink)) for s, e in p.modules] if sink else []
    chosen = set(torch.cat(out).tolist()) if out else set()
    for i in order:
        if len(chosen) >= budget:
            break
        s, e = p.modules[i]
        for t in range(s, e):
            if len(chosen) >= budget:
                break
            chosen.add(t)
    return torch.tensor(sorted(chosen)[:budget] if len(chosen) > budget else sorted(chosen), dtype=torch.long)


def note_rank(model, p, base, layers=slice(None), reduce: str = "sum") -> list[int]:
    """Modules ranked by the question's attention over the reused state (sum or max over a module's
    tokens), highest first."""
    s = question_attention(model, p, base, layers)
    cand = p.candidates
    mass = []
    for s0, e0 in p.modules:
        v = s[(cand >= s0) & (cand < e0)]
        mass.append(float(v.sum() if reduce == "sum" else v.max()))
    return sorted(range(len(mass)), key=lambda i: (-mass[i], i))


def qattn_note(model, p, base, budget, sink: int = 2, layers=slice(None), reduce: str = "sum"):
    """Whole notes chosen by the question: modules ranked by the question's attention mass over the
    reused state, recomputed entirely in rank order, plus the first ``sink`` tokens of every
    module (sink repair); the last module that does not fit gets its first tokens."""
    order = note_rank(model, p, base, layers, reduce)
    return whole_notes(p, order, budget, sink), None, p.suffix.numel()


def oracle_note(model, p, base, budget):
    """Diagnostic (reads ``p.target``): the module holding the answer first, whole, then the rest of
    the budget by question attention. The ceiling of any note-choosing selection."""
    order = [p.target] + [i for i in note_rank(model, p, base) if i != p.target]
    return whole_notes(p, order, budget), None, p.suffix.numel()


def oracle_after(model, p, base, budget):
    """Diagnostic: the answer's module and every module after it (the budget is ignored): are
    stale modules before the answer harmless?"""
    s0 = p.modules[p.target][0]
    return p.candidates[p.candidates >= s0], None, 0


def cacheblend_iter(model, p, base, budget, until: int = 4):
    """CacheBlend proper, iterated: every module token is computed afresh at layer 0; after each
    layer up to ``until`` the set shrinks geometrically towards ``budget``, keeping the tokens
    with the largest K+V deviation from the cached state at that layer; the ``budget`` survivors
    go through the remaining layers."""
    cand = set(p.candidates.tolist())
    c = len(cand)

    def narrow(li, active, fresh):
        if li > until - 1:
            return torch.ones(active.numel(), dtype=torch.bool)
        size = budget if li == until - 1 else round(c * (budget / max(c, 1)) ** ((li + 1) / until))
        k, v = fresh
        dev = ((k - base[li][0][:, :, active]).norm(dim=-1) + (v - base[li][1][:, :, active]).norm(dim=-1)).sum((0, 1))
        is_cand = torch.tensor([int(a) in cand for a in active])
        dev = torch.where(is_cand, dev, torch.full_like(dev, -1.0))
        keep = ~is_cand
        keep[torch.sort(dev, descending=True, stable=True).indices[:size]] = True
        return keep
    return p.candidates, narrow, 0


def request(p):
    """The engine's ``RecomputeRequest`` for a reference prompt: the modules as spans, the suffix
    (the question, never the forced answer) as the new tokens."""
    from promptcache.engine.prefill.recompute import RecomputeRequest

    ids = p.ids.tolist()
    return RecomputeRequest(fraction=0.0, selection="qmatch", slot_order=list(range(p.n)), slot_ids=ids,
                            slot_pos=list(range(p.n)), new_order=[], candidates=p.candidates.tolist(),
                            spans=list(p.modules), new_ids=[ids[i] for i in p.suffix.tolist()])


def _engine_selection(name: str):
    """An engine selection (``promptcache.engine.prefill.recompute.SELECTIONS``) that reads token ids only,
    on a reference prompt. No forward pass to choose."""
    def run(model, p, base, budget):
        from promptcache.engine.prefill.recompute import SELECTIONS as ENGINE

        return torch.tensor(ENGINE[name](None, request(p), budget), dtype=torch.long), None, 0
    return run


# the engine's default (the named modules, then prompt order) and the third step's order (for the record)
qmatch, qmatch_later = _engine_selection("qmatch"), _engine_selection("qmatch_later")


SELECTIONS = {
    "none": none, "epic": epic, "tail": tail, "cacheblend": cacheblend, "qattn": qattn,
    "qattn_last": lambda m, p, b, k: qattn(m, p, b, k, last=1),
    "qattn_late": lambda m, p, b, k: qattn(m, p, b, k, layers=slice(15, None)),
    "qattn_bound": qattn_bound, "qattn_module": qattn_module, "qattn_iter": qattn_iter,
    "qattn_note": qattn_note, "qattn_note_max": lambda m, p, b, k: qattn_note(m, p, b, k, reduce="max"),
    "qattn_note_late": lambda m, p, b, k: qattn_note(m, p, b, k, layers=slice(15, None)),
    "cacheblend_iter": cacheblend_iter, "oracle_note": oracle_note, "oracle_after": oracle_after, "qmatch": qmatch,
    "qmatch_later": qmatch_later,
}
