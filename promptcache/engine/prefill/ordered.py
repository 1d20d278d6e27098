"""Selective recompute as rows of a step: a prompt's plan in prompt order.

A drifted prompt that recomputes part of its cached tokens (``recompute.py`` chooses which) is
planned like any other: its stored states are read where they are (the pool, a store tier's
tensors) and what runs through the model is the request's own prefill rows, chunked and
batched with other requests' rows by the scheduler. ``ordered_plan`` turns the plain plan
(cached spans in KV order, then the new tokens) into that:

  * the chosen cached tokens leave their segments (a segment is cut into the runs between them;
    their stale stored copies are never read) and join the new tokens as rows, all in prompt
    order (``PrefillPlan.new_order``: the prompt index of each row);
  * every segment keeps the prompt index of its first token (``Segment.order``), so a query sees
    exactly the keys at or before it in prompt order: a prefix of each segment (a key limit per
    query, as the ordered-attention kernel reads them) and its own earlier rows (causal);
  * a selection that scales reused keys (``KEY_SCALES``, APE's temperature) gets those runs as
    scaled copies under their own keys.

This computes what ``run_recompute`` computes in a private buffer (the chosen tokens written over
their slots, a mask causal by prompt order): the same keys are seen by the same queries, so the
logits agree within float rounding. A plan with nothing chosen is the paper's splice and keeps
no order (every new token sees every segment).
"""

from __future__ import annotations

from dataclasses import replace

from .plan import PrefillPlan, Segment
from .recompute import RecomputeRequest

__all__ = ["ordered_plan"]

_KEPT, _CHOSEN, _SCALED = 0, 1, 2


def ordered_plan(plan: PrefillPlan, req: RecomputeRequest, chosen: list[int], scaled: list[int] = (),
                 scale: float | None = None) -> PrefillPlan:
    """``plan`` (its segments hold the cached slots 0.. of ``req`` in order, its new tokens are
    ``req.new_order``'s) with the cached slots ``chosen`` recomputed as rows and the keys of the
    slots ``scaled`` multiplied by ``scale``. Returns ``plan`` itself when neither applies."""
    n_cached = len(req.slot_order)
    if plan.cached_tokens != n_cached or len(plan.new_ids) != len(req.new_order):
        raise ValueError(f"a recompute request over {n_cached} cached and {len(req.new_order)} new tokens does not "
                         f"match a plan of {plan.cached_tokens} cached and {len(plan.new_ids)} new tokens")
    if not chosen and not scaled:
        return plan
    if scaled and scale is None:
        raise ValueError("scaled slots need a scale")
    kind = [_KEPT] * n_cached
    for s in scaled:
        kind[s] = _SCALED
    for s in chosen:
        kind[s] = _CHOSEN
    ordered = bool(chosen)
    segments, start = [], 0
    for seg in plan.segments:
        runs = _runs(kind[start : start + seg.n])
        if runs == [(_KEPT, 0, seg.n)]:
            segments.append(replace(seg, order=req.slot_order[start]) if ordered else seg)
        else:
            segments += _cut(seg, runs, req.slot_order[start:], scale, ordered)
        start += seg.n
    if not ordered:
        return replace(plan, segments=segments)
    rows = sorted([(req.slot_order[s], req.slot_ids[s], req.slot_pos[s]) for s in chosen]
                  + list(zip(req.new_order, plan.new_ids, plan.new_pos)))  # [(prompt index, id, position)]
    exact = plan.exact
    if len(chosen) == len(req.candidates) and plan.layout is not None:  # every drifted token recomputed
        exact = exact or list(plan.layout.position_ids) == list(range(len(plan.layout.position_ids)))
    return replace(plan, segments=segments, new_ids=[r[1] for r in rows], new_pos=[r[2] for r in rows],
                   new_order=[r[0] for r in rows], exact=exact, recomputed=len(chosen))


def _runs(kinds: list[int]) -> list[tuple[int, int, int]]:
    """Maximal runs (kind, a, b) of equal kinds."""
    out, a = [], 0
    for i in range(1, len(kinds) + 1):
        if i == len(kinds) or kinds[i] != kinds[a]:
            out.append((kinds[a], a, i))
            a = i
    return out


def _cut(seg: Segment, runs: list[tuple[int, int, int]], order: list[int], scale: float | None,
         ordered: bool) -> list[Segment]:
    """The segment's runs that stay stored (kept as they are, or scaled copies), each named by its
    slice so that pool entries and cascade reads never confuse it with the whole segment."""
    kv = seg.kv if seg.kv is not None else seg.states()  # [L, 2, H, n, D] (as stored: read shifted)
    out = []
    for kind, a, b in runs:
        if kind == _CHOSEN:
            continue
        part, key = kv[:, :, :, a:b], f"{seg.key}[{a}:{b}]"
        if kind == _SCALED:
            part = part.clone()
            part[:, 0].mul_(scale)  # keys only: q . (s k) = s (q . k)
            key += f"*{scale}"
        # a kept run is a view of the stored states (a pool may hold them whole, once for every cut)
        whole = seg.part_of if seg.part_of is not None else (seg.key, seg.kv, 0) if seg.kv is not None else None
        within = (whole[0], whole[1], whole[2] + a) if kind == _KEPT and whole is not None else None
        out.append(Segment(key, part, seg.positions[a:b], promote=seg.promote, order=order[a] if ordered else None,
                           shift=seg.shift, part_of=within))
    return out
