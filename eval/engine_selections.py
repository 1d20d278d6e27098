"""Engine selections only the studies use, registered with the engine on import
(``promptcache.engine.prefill.recompute.register_selection``); then
``EngineConfig(recompute=RecomputeConfig(selection="qattn_mix"))`` or ``"qmatch_later"`` works like
the library's own.

Kept here, not in the library, because no user needs them: each lost to ``qmatch`` in the
measurements (eval/results/quality.md); the studies re-run them.
"""

from __future__ import annotations

from promptcache.engine.prefill.recompute import (APE_KEY_SCALE, QuestionPass, RecomputeRequest, fill, match_order,
                                                  named_spans, qattn, qmatch, register_selection, tail, top)

__all__ = ["APE_MILD_KEY_SCALE", "APE_SHARP_KEY_SCALE", "SINK_SKIP", "ape_mild", "ape_named", "ape_sharp", "qattn_eighth", "qattn_half", "qattn_mix", "qdoc", "qmatch_later", "qnamed",
           "qtok", "span_mass"]

APE_SHARP_KEY_SCALE = 1.1  # 1 / T = 1.1 (T = 0.91, sharper), against the library's ``ape`` at 0.8 (softer)


def qattn_mix(scores, req: RecomputeRequest, k: int) -> list[int]:
    """Whole spans ranked by mean question attention (late layers) while they fit in the budget,
    then the rest of the budget by token-level question attention over the remaining candidates."""
    if scores is None:
        return tail(None, req, k)
    mass = [float(scores[a:b].mean()) for a, b in req.spans]
    out, left = [], k
    for i in sorted(range(len(mass)), key=lambda i: (-mass[i], i)):
        a, b = req.spans[i]
        if b - a <= left:
            out += range(a, b)
            left -= b - a
    rest = sorted(set(req.candidates) - set(out))
    return sorted(out + (top(scores, rest, left) if left and rest else []))


def qmatch_later(scores, req: RecomputeRequest, k: int) -> list[int]:
    """The third step's order, kept for the record: every span in ``match_order`` (the named ones,
    then the unmatched from the end, like ``tail``). More budget than the named spans mixes fresh
    and stale notes and lost answers (67% of full prefill at r = 0.3 against ``qmatch``'s 106%)."""
    if not req.spans:
        return tail(None, req, k)
    return fill(req, match_order(req), k)


register_selection("qattn_mix", qattn_mix, scores_from=0.5)  # the second half of the layers
register_selection("qmatch_later", qmatch_later)


def qattn_eighth(scores, req: RecomputeRequest, k: int) -> list[int]:
    """``qattn``'s ranking from the first eighth of the layers (the pass stops there)."""
    return qattn(scores, req, k)


def qattn_half(scores, req: RecomputeRequest, k: int) -> list[int]:
    """``qattn``'s ranking from the first half of the layers (the pass stops there)."""
    return qattn(scores, req, k)


# the layer study beside ``qattn`` (every layer) and ``qattn_fast`` (the first third): eval/results/fidelity.md
register_selection("qattn_eighth", qattn_eighth, question_pass=QuestionPass(stop=1 / 8))
register_selection("qattn_half", qattn_half, question_pass=QuestionPass(stop=1 / 2))


def ape_sharp(scores, req: RecomputeRequest, k: int) -> list[int]:
    """``ape`` with a sharper temperature (``APE_SHARP_KEY_SCALE``): ``qmatch``'s tokens recomputed,
    the other reused documents' keys scaled."""
    return qmatch(scores, req, k)


register_selection("ape_sharp", ape_sharp, key_scale=APE_SHARP_KEY_SCALE)


def ape_named(scores, req: RecomputeRequest, k: int) -> list[int]:
    """``ape`` that leaves the documents the question names unscaled (``spare_named``): on the
    memo task ``ape`` flattened the attention over the named memo's unrecomputed clue."""
    return qmatch(scores, req, k)


register_selection("ape_named", ape_named, key_scale=APE_KEY_SCALE, spare_named=True)


# -- issue 36: question-driven document selections (the question's attention over the reused states) --
# Measured on 20 samples of the retrieval and memo tasks (eval/results/rag_default_issue36.md):
# neither ``qdoc`` nor ``qtok`` kept as many answers as ``qmatch`` on retrieval (the question's
# attention does not find the note it names), about as many on memo; so they stay study selections.
SINK_SKIP = 1  # a span's first token: an isolated encoding made it an attention sink; its mass is not relevance


def span_mass(scores, req: RecomputeRequest, skip: int = SINK_SKIP) -> list[float]:
    """Per candidate span, the question's attention mass summed over its tokens after the first
    ``skip`` (the sink an isolated encoding put there draws mass whatever the question asks)."""
    return [float(scores[min(a + skip, b - 1):b].sum()) for a, b in req.spans]


def qdoc(scores, req: RecomputeRequest, k: int) -> list[int]:
    """Whole documents in the order of the question's attention mass (``span_mass``), the budget
    filled in that order, the last one partly (its first tokens)."""
    if scores is None or not req.spans:
        return qmatch(scores, req, k)
    mass = span_mass(scores, req)
    return fill(req, sorted(range(len(mass)), key=lambda i: (-mass[i], i)), k)


def qnamed(scores, req: RecomputeRequest, k: int) -> list[int]:
    """The documents the question names (``named_spans``), then the others by the question's
    attention mass (where ``qmatch`` takes them in prompt order)."""
    if scores is None or not req.spans:
        return qmatch(scores, req, k)
    named, mass = named_spans(req), span_mass(scores, req)
    return fill(req, named + sorted((i for i in range(len(mass)) if i not in named), key=lambda i: (-mass[i], i)), k)


def qtok(scores, req: RecomputeRequest, k: int, width: int = 1) -> list[int]:
    """The tokens the question attends to most (each span's sink excluded) with ``width``
    neighbours on each side, taken best first until the budget is spent."""
    if scores is None or not req.spans:
        return qmatch(scores, req, k)
    sinks = {a for a, b in req.spans}
    cand = [s for s in req.candidates if s not in sinks]
    ranked = top(scores, cand, len(cand))  # sorted by slot; re-rank by score
    ranked = sorted(ranked, key=lambda s: (-float(scores[s]), s))
    cset, out = set(req.candidates), set()
    for s in ranked:
        if len(out) >= k:
            break
        for t in range(s - width, s + width + 1):
            if t in cset and len(out) < k:
                out.add(t)
    return sorted(out)


for _name, _fn in (("qdoc", qdoc), ("qnamed", qnamed), ("qtok", qtok)):
    register_selection(_name, _fn, scores_from=0.0)
    register_selection(f"{_name}_ape", _fn, scores_from=0.0, key_scale=APE_KEY_SCALE)


def ape_mild(scores, req: RecomputeRequest, k: int) -> list[int]:
    """``ape`` at a milder temperature (``APE_MILD_KEY_SCALE``, T = 1.11): between ``qmatch`` (1.0)
    and ``ape`` (0.8), for issue 36's question whether a gentler scale keeps retrieval's gain
    without the memo task's loss."""
    return qmatch(scores, req, k)


APE_MILD_KEY_SCALE = 0.9
register_selection("ape_mild", ape_mild, key_scale=APE_MILD_KEY_SCALE)
