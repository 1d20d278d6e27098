"""Selective recompute: a fraction of a prompt's reused states computed afresh in its own context.

The knob (``recompute=r`` on ``PromptCache.prefill/generate/stream`` and ``DocumentStore``): of
the prompt's *drifted* cached tokens (``RecomputeRequest.candidates``: cached tokens whose stored
states are not already those of a plain prefill; the leading cached spans encoded after exactly
the spans before them are not candidates) ``round(r * len(candidates))`` are chosen by a
selection, then ONE forward runs the chosen cached tokens (written in place at their slots with
``write_slots``) followed by the new tokens, with a causal-by-prompt-order mask: every query sees
every slot whose token comes at or before it in prompt order, cached (stale) or recomputed.
``r = 1.0`` therefore equals a plain forward over the prompt's tokens in prompt order at the
layout's positions. When nothing is chosen the ordinary splice runs (the paper's definition).

``recompute="auto"`` (the default everywhere, ``AUTO``): the engine picks the budget. A prompt
whose cached states are all a plain prefill's has no candidates and recomputes nothing (no extra
work); a drifted prompt recomputes ``AUTO_FRACTION`` of its drifted tokens with the default
selection. The rule was fixed by measurement on SmolLM2-135M-Instruct: of the fractions tried,
the smallest kept the most answers for independent modules and documents, in order and
shuffled, at the lowest TTFT (eval/results/quality.md). A number is still exactly that fraction.

Selections (``SELECTIONS``, by name; ``DEFAULT_SELECTION`` chosen by measurement, see
eval/results/quality.md): each is ``(scores | None, request, budget) -> slots``. Question-aware
selections need the question's attention over the reused cache (``SCORED``: name -> the layers and
queries that count, ``QuestionPass``): the new tokens run over the assembled cache through the
read layers and stop there (``question_pass.question_scores``; no eager attention). ``qattn``
reads every layer (about one r=0 prefill of the new tokens more in TTFT); ``qattn_fast`` the same
ranking from the layers ``QATTN_FAST`` names (a fraction of that; eval/results/fidelity.md). The
library keeps the selections it uses or that stand as baselines (``tail``, ``qattn``,
``qattn_fast``, ``qattn_module``, ``qmatch``, and for documents ``epic`` (EPIC-style boundaries)
and ``anchored`` (boundaries, then ``qmatch``)); a study adds its own with ``register_selection``
(the studies' ``qattn_mix`` and ``qmatch_later`` live in ``eval/engine_selections.py``), after which
``RecomputeConfig(selection=name)`` accepts the name.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch

from ...layout import PromptLayout
from .budget import AUTO, AUTO_FRACTION, DEFAULT_SELECTION, check_fraction, check_recompute, fraction_of
from .question_pass import QuestionPass, question_attention, question_scores

__all__ = ["APE_KEY_SCALE", "AUTO", "AUTO_FRACTION", "BOUNDARY_TOKENS", "DEFAULT_SELECTION", "KEY_SCALES",
           "QuestionPass", "RecomputeRequest", "SCORED", "SELECTIONS", "SPARE_NAMED", "anchored", "ape", "boundaries", "check_fraction", "check_recompute", "check_selection", "choose", "epic",
           "fraction_of", "recompute_request", "fill", "match_order", "named_spans", "question_attention", "question_scores", "register_selection",
           "run_recompute", "scale_reused_keys", "scaled_slots", "spared_slots", "tail", "top"]



@dataclass(frozen=True, kw_only=True)
class RecomputeRequest:
    fraction: float  # r in [0, 1]
    selection: str  # a name in SELECTIONS
    slot_order: list[int]  # [n_cached]: prompt index (0..n-1) of the token at each cached slot
    slot_ids: list[int]  # [n_cached]: token id at each cached slot
    slot_pos: list[int]  # [n_cached]: position id at each cached slot
    new_order: list[int]  # [T]: prompt index of each new token, in input order
    candidates: list[int]  # cached slots a selection may choose (ascending)
    spans: list[tuple[int, int]]  # cached slot ranges [a, b) of the candidate spans (documents, modules)
    new_ids: list[int] = ()  # [T]: token id of each new token, in input order (the question, for qmatch)

    @property
    def budget(self) -> int:
        return round(self.fraction * len(self.candidates))


def check_selection(name: str) -> str:
    if name not in SELECTIONS:
        raise ValueError(f"unknown recompute selection {name!r} (known: {', '.join(SELECTIONS)})")
    return name


def recompute_request(layout: PromptLayout, n_exact: int, fraction: float, selection: str,
                      moved_last: bool) -> RecomputeRequest:
    """The request for a prompt laid out as ``layout`` (spans in prompt order, cached spans at slots
    0.. in that order, new tokens after them): ``n_exact`` leading cached tokens are already exact
    (not candidates); ``moved_last``: the prompt had no new token, so its last cached token runs as
    the new one (assemble's rule)."""
    slot_order, slot_ids, slot_pos, new_order, new_ids, spans, i, slot = [], [], [], [], [], [], 0, 0
    for s in layout.spans:
        n = len(s.token_ids)
        if s.kind == "cached":
            slot_order += range(i, i + n)
            slot_ids += s.token_ids
            slot_pos += s.position_ids
            if slot + n > n_exact:
                spans.append((max(slot, n_exact), slot + n))
            slot += n
        else:
            new_order += range(i, i + n)
            new_ids += s.token_ids
        i += n
    if moved_last:
        new_order, new_ids = [slot_order.pop()], [slot_ids[-1]]
        del slot_ids[-1], slot_pos[-1]
        spans = [(a, min(b, len(slot_order))) for a, b in spans if min(b, len(slot_order)) > a]
    cand = list(range(min(n_exact, len(slot_order)), len(slot_order)))
    return RecomputeRequest(fraction=fraction, selection=check_selection(selection), slot_order=slot_order,
                            slot_ids=slot_ids, slot_pos=slot_pos, new_order=new_order, candidates=cand, spans=spans,
                            new_ids=new_ids)


# -- selections: (scores [n_cached] | None, request, budget) -> cached slots [<= budget] ------------
def top(scores: torch.Tensor, slots: list[int], k: int) -> list[int]:
    """The ``k`` slots with the highest score, earlier slot first among equals."""
    s = scores[torch.tensor(slots, dtype=torch.long)]
    order = torch.sort(s, descending=True, stable=True).indices[:k]
    return sorted(slots[int(i)] for i in order)


def tail(scores, req: RecomputeRequest, k: int) -> list[int]:
    """The last ``k`` candidates: everything before them reused, what follows exact given them."""
    return req.candidates[len(req.candidates) - k:] if k else []


def qattn(scores, req: RecomputeRequest, k: int) -> list[int]:
    """A3 / ProphetKV-like: the candidates the question attends to most over the reused state."""
    return top(scores, req.candidates, k) if scores is not None else tail(None, req, k)


def fill(req: RecomputeRequest, order, k: int) -> list[int]:
    """Up to ``k`` slots: whole candidate spans taken in ``order`` (span indices), the first that
    does not fit gets its first tokens. The spans cover the candidates, so ``k`` slots are found."""
    out: list[int] = []
    for i in order:
        if len(out) >= k:
            break
        a, b = req.spans[i]
        out += range(a, a + min(k - len(out), b - a))
    return sorted(out)


def qattn_module(scores, req: RecomputeRequest, k: int) -> list[int]:
    """Whole spans (modules, documents) ranked by the question's mean attention per token; the
    budget fills spans in rank order, the last one partly (its first tokens)."""
    if scores is None:
        return tail(None, req, k)
    mass = [float(scores[a:b].mean()) for a, b in req.spans]
    return fill(req, sorted(range(len(mass)), key=lambda i: (-mass[i], i)), k)


def match_scores(req: RecomputeRequest) -> list[float]:
    """Per candidate span, how well it matches the new tokens (the question): BM25's idf summed
    over the distinct new token ids the span holds, the document frequency counted over the
    prompt's own candidate spans. A token every span holds ("the", "code") weighs almost nothing;
    one only the answer's span holds (the colour, a name) weighs most. Token ids, no tokenizer."""
    sets = [set(req.slot_ids[a:b]) for a, b in req.spans]
    m, q = len(sets), set(req.new_ids)
    df: dict[int, int] = {}
    for st in sets:
        for t in st & q:
            df[t] = df.get(t, 0) + 1
    idf = {t: math.log((m - d + 0.5) / (d + 0.5) + 1.0) for t, d in df.items()}
    return [sum(idf[t] for t in st & q) for st in sets]


def match_order(req: RecomputeRequest) -> list[int]:
    """Span indices by ``match_scores``, best first; among equal scores the later span first."""
    score = match_scores(req)
    return sorted(range(len(score)), key=lambda i: (-score[i], -i))


def named_spans(req: RecomputeRequest) -> list[int]:
    """The spans the question names: ``match_scores`` at least half the best (and above 0), best
    first. On the retrieval task the best-matching span is the answer's span in 24 of 24 pilot
    questions (eval/results/quality.md)."""
    score = match_scores(req)
    top = max(score, default=0.0)
    if top <= 0:
        return []
    return sorted((i for i, x in enumerate(score) if x >= top / 2), key=lambda i: (-score[i], -i))


def qmatch(scores, req: RecomputeRequest, k: int) -> list[int]:
    """The spans the question names (``named_spans``), then the other spans in prompt order,
    earliest first; each recomputed entirely, the first that does not fit gets its first tokens.
    The rest of the budget thus grows an exact-in-order head (a recomputed span whose preceding
    spans are all recomputed holds a plain prefill's states), so more budget converges on full
    prefill instead of mixing fresh notes among stale ones (measured: eval/results/quality.md).
    Needs no extra forward (the ranking reads token ids only): it costs the recomputed tokens."""
    if not req.spans:
        return tail(None, req, k)
    named = named_spans(req)
    return fill(req, named + [i for i in range(len(req.spans)) if i not in named], k)


BOUNDARY_TOKENS = 4  # a span's first tokens: where an isolated encoding put its attention sink


def boundaries(req: RecomputeRequest, k: int, per_span: int = BOUNDARY_TOKENS) -> list[int]:
    """Up to ``k`` slots: the first ``per_span`` tokens of every candidate span, in span order.
    A document encoded alone starts at position 0, so its first token became an attention sink
    and the tokens after it leaned on it; in the prompt that token sits mid-context, and the
    question's attention to it (and its outsized states) is the drift EPIC (LegoLink) removes by
    recomputing it in the prompt's own context."""
    out: list[int] = []
    for a, b in req.spans:
        if len(out) >= k:
            break
        out += range(a, min(b, a + per_span, a + k - len(out)))
    return out


def epic(scores, req: RecomputeRequest, k: int) -> list[int]:
    """EPIC-style (LegoLink): the budget split evenly over the spans' first tokens only (an anchor
    for documents; it reads no question). Spans shorter than their share give the rest to the
    others' next tokens, so ``k`` slots are chosen."""
    if not req.spans:
        return tail(None, req, k)
    per = -(-k // len(req.spans))  # ceil
    out = boundaries(req, k, per_span=per)
    while len(out) < k and per < max(b - a for a, b in req.spans):
        per += 1
        out = boundaries(req, k, per_span=per)
    return sorted(out)


def anchored(scores, req: RecomputeRequest, k: int) -> list[int]:
    """Every span's boundary (``boundaries``: the first ``BOUNDARY_TOKENS`` tokens, EPIC's sinks),
    then ``qmatch`` with the rest of the budget (the spans the question names, then prompt order).
    Reads token ids only: no extra forward. Measured on RAG documents (docs/rag.md): a lower
    first-token KL than ``qmatch`` at the same budget, but fewer answers kept where the
    boundaries take the budget the named document needed, so ``qmatch`` stays the default."""
    if not req.spans:
        return tail(None, req, k)
    head = boundaries(req, k)
    taken, named = set(head), named_spans(req)
    rest: list[int] = []
    for i in named + [i for i in range(len(req.spans)) if i not in named]:
        if len(head) + len(rest) >= k:
            break
        a, b = req.spans[i]
        rest += [s for s in range(a, b) if s not in taken][: k - len(head) - len(rest)]
    return sorted(head + rest)


def ape(scores, req: RecomputeRequest, k: int) -> list[int]:
    """APE-style (Yang et al., ICLR 2025: adaptive parallel encoding, no training): what ``qmatch``
    chooses is recomputed, and the other reused documents' keys are scaled by ``APE_KEY_SCALE``
    (``KEY_SCALES``): an attention temperature T = 1 / scale on the spans encoded alone (measured on
    SmolLM2: a softer attention over them, T = 1.25, lowered the first-token KL; a sharper one,
    T = 0.91, raised it). APE's second factor (a scale on the reused
    spans' share of the softmax) would need an additive mask through every attention backend
    and is not applied."""
    return qmatch(scores, req, k)


APE_KEY_SCALE = 0.8  # 1 / T (T = 1.25, a softer attention): of 0.8, 0.9, 1.0 and 1.1 the lowest first-token KL (docs/rag.md)

def qattn_fast(scores, req: RecomputeRequest, k: int) -> list[int]:
    """``qattn``'s ranking (the candidates the question attends to most) read from a cheap pass:
    the layers and queries ``QATTN_FAST`` names, the forward stopped after the last of them."""
    return qattn(scores, req, k)


QATTN_FAST = QuestionPass(stop=1 / 3)  # the first third of the layers, every new token's queries

SELECTIONS: dict[str, Callable] = {"tail": tail, "qattn": qattn, "qattn_fast": qattn_fast,
                                   "qattn_module": qattn_module, "qmatch": qmatch, "epic": epic,
                                   "anchored": anchored, "ape": ape}
# selections that read the question's attention: name -> the layers and queries that count
# (``QuestionPass``; the pass stops after its last read layer)
SCORED: dict[str, QuestionPass] = {"qattn": QuestionPass(), "qattn_module": QuestionPass(),
                                   "qattn_fast": QATTN_FAST}
# selections that scale the reused candidates' keys (APE's temperature): name -> the key scale (1 / T)
KEY_SCALES: dict[str, float] = {"ape": APE_KEY_SCALE}
SPARE_NAMED: set[str] = set()  # of those, the ones that leave the named spans' keys as they are


def register_selection(name: str, fn: Callable, *, scores_from: float | None = None,
                       question_pass: QuestionPass | None = None, key_scale: float | None = None,
                       spare_named: bool = False) -> None:
    """Make ``fn`` (``(scores | None, request, budget) -> slots``) the selection ``name``.
    ``question_pass``: the selection reads the question's attention over the layers and queries it
    names; ``scores_from``: shorthand for ``QuestionPass(first=scores_from)`` (summed from this
    fraction of the layers on). Neither: it reads none and costs no extra forward. ``key_scale``: the reused (not
    recomputed) candidate tokens' keys are multiplied by it (``KEY_SCALES``: APE's attention
    temperature, 1 / T); ``spare_named``: not those of the spans the question names (``named_spans``).
    A name already taken by another function is refused (registering the same function again is a
    no-op)."""
    if SELECTIONS.get(name, fn) is not fn:
        raise ValueError(f"recompute selection {name!r} is already registered (known: {', '.join(SELECTIONS)})")
    if scores_from is not None and not 0.0 <= scores_from < 1.0:
        raise ValueError(f"scores_from must be a fraction in [0, 1), got {scores_from!r}")
    if key_scale is not None and not (isinstance(key_scale, (int, float)) and 0.0 < key_scale < 10.0):
        raise ValueError(f"key_scale must be a number in (0, 10), got {key_scale!r}")
    if scores_from is not None and question_pass is not None:
        raise ValueError("pass either scores_from or question_pass, not both")
    SELECTIONS[name] = fn
    if scores_from is not None:
        question_pass = QuestionPass(first=float(scores_from))
    if question_pass is not None:
        SCORED[name] = question_pass
    if key_scale is not None:
        KEY_SCALES[name] = float(key_scale)
    if spare_named:
        SPARE_NAMED.add(name)


def scale_reused_keys(cache, req: RecomputeRequest, chosen: list[int], scale: float) -> int:
    """APE-style attention temperature: multiply the keys of the candidate slots not in ``chosen``
    (the recomputed ones, and any the selection spares)
    (every layer, every head) by ``scale``, so every later query's logits over them are scaled by
    it (``q . (s k) = s (q . k)``; rotary keys are linear in k, so the rotation is unaffected).
    The cache's residents from the first scaled slot on are forgotten (the buffer no longer holds
    the stored states there). Returns the number of slots scaled."""
    taken, runs, start, prev = set(chosen), [], None, None
    for s in req.candidates:
        if s in taken:
            continue
        if start is None or s != prev + 1:
            if start is not None:
                runs.append((start, prev + 1))
            start = s
        prev = s
    if start is not None:
        runs.append((start, prev + 1))
    if not runs:
        return 0
    low = runs[0][0]
    if cache.resident:
        cache.resident = {off: kn for off, kn in cache.resident.items() if off + kn[1] <= low}
    for a, b in runs:
        cache.buf[:, 0, :, :, a:b].mul_(scale)  # [L, 2, B, H, S, D]: keys of slots a..b-1
    return sum(b - a for a, b in runs)


# -- what a request recomputes ----------------------------------------------------------------------
def spared_slots(req: RecomputeRequest) -> list[int]:
    """Candidate slots a key-scaling selection leaves as they are (``SPARE_NAMED``: the named spans)."""
    return [s for i in named_spans(req) for s in range(*req.spans[i])] if req.selection in SPARE_NAMED else []


def choose(req: RecomputeRequest, scores: torch.Tensor | None = None) -> list[int]:
    """The cached slots the request's selection recomputes (ascending; none for a budget of 0).
    ``scores``: the question's attention per cached slot, for the selections in ``SCORED``."""
    k = min(req.budget, len(req.candidates))
    return sorted(SELECTIONS[req.selection](scores, req, k)) if k else []


def scaled_slots(req: RecomputeRequest, chosen: list[int]) -> list[int]:
    """The reused candidate slots whose keys a ``KEY_SCALES`` selection scales (none for the others):
    every candidate not chosen and not spared."""
    if req.selection not in KEY_SCALES:
        return []
    keep = set(chosen) | set(spared_slots(req))
    return [s for s in req.candidates if s not in keep]


# -- the forward in a private buffer ------------------------------------------------------------------
def run_recompute(adapter, cache, req: RecomputeRequest, new_ids: list[int], new_pos: list[int],
                  ids: torch.Tensor, pos: torch.Tensor) -> tuple[torch.Tensor, int]:
    """On an assembled ``cache`` (cached spans at slots 0..n_cached-1, length n_cached), recompute
    the selected cached slots and run the new tokens (``ids``/``pos``: ``new_ids``/``new_pos`` as
    [1, T] tensors on the cache's device, built by the caller before placing the spans). Returns
    (last-token logits [V], number of cached tokens recomputed). With nothing selected: the
    ordinary splice forward."""
    n_cached = len(req.slot_order)
    device = cache.buf.device
    k = min(req.budget, len(req.candidates))
    scale = KEY_SCALES.get(req.selection)
    spared = spared_slots(req)
    if k == 0:
        if scale is not None:
            scale_reused_keys(cache, req, spared, scale)
        return adapter.forward(ids, pos, cache)[0], 0
    scores = None
    if req.selection in SCORED:  # the question over the reused state (the cache keeps its length)
        scores = question_scores(adapter, cache, ids, pos, SCORED[req.selection])  # [n_cached]
    chosen = choose(req, scores)
    if scale is not None:  # before the forward: the recomputed tokens and the question see the scaled keys
        scale_reused_keys(cache, req, sorted(set(chosen) | set(spared)), scale)
    # inputs in prompt order: chosen cached tokens and the new tokens (the last prompt token is new)
    rows = sorted([(req.slot_order[s], req.slot_ids[s], req.slot_pos[s], s) for s in chosen]
                  + [(o, tid, p, n_cached + j) for j, (o, tid, p) in enumerate(zip(req.new_order, new_ids, new_pos))])
    order = torch.tensor(req.slot_order + req.new_order, device=device)  # [kv_len]: prompt index per slot
    q = torch.tensor([r[0] for r in rows], device=device)
    mask = (order[None, :] <= q[:, None])[None, None]  # [1, 1, Q, kv_len], True = attend
    logits = adapter.forward(torch.tensor([[r[1] for r in rows]], device=device),
                             torch.tensor([[r[2] for r in rows]], device=device), cache,
                             write_slots=torch.tensor([r[3] for r in rows], device=device), attention_mask=mask)
    return logits[0], len(chosen)
