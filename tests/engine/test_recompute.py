"""Selective recompute through the engine (``PromptCache.prefill(..., recompute=r)``, issue 11).

``recompute=1.0`` must equal a plain forward over the prompt's tokens in prompt order at the
layout's position IDs, for every family (float32, <= 1e-4), on prompts whose reused states
drift: independently encoded modules (unions) and imports with gaps and text between them.
Partial recompute reports what it did and is not called exact; recompute=0 is the paper's splice.
"""

from __future__ import annotations

import pytest
import torch

from oracle import plain_logits_at
from promptcache import EngineConfig, PromptCache, RecomputeConfig
from eval import engine_selections  # the studies' selections: registered, so tested here too
from promptcache.engine.prefill.recompute import SELECTIONS, register_selection
from tiny import FAMILIES, make_model, make_tokenizer

TOL = 1e-4

SCHEMA = """<schema name="s">
  <system>You are a travel planner.</system>
  <user>
    <module name="a">Paris is the capital of France, famous for museums.</module>
    <union><module name="b">Tokyo is a huge city in Japan with temples.</module></union>
    <union><module name="c">Keep it cheap. Highlight the food.</module></union>
    <module name="d">The quick brown fox jumps over the lazy dog.</module>
  </user>
</schema>"""

GAPPED = '<prompt schema="s"><a/> Plan a trip. <c/><d/> Answer in one short paragraph.</prompt>'
UNIONS = '<prompt schema="s"><a/><b/><c/><d/><user>Which city has temples?</user></prompt>'
NO_NEW = '<prompt schema="s"><b/><c/></prompt>'


def _engine(family: str, **recompute) -> PromptCache:
    name, _, attn = family.partition(":")
    pc = PromptCache(make_model(name, attn=attn or None), make_tokenizer(), EngineConfig(recompute=RecomputeConfig(**recompute)))
    pc.add_schema(SCHEMA)
    return pc


@pytest.mark.parametrize("family", FAMILIES + ["llama:eager"])
@pytest.mark.parametrize("prompt", [GAPPED, UNIONS, NO_NEW])
def test_recompute_all_equals_plain_forward(family, prompt):
    pc = _engine(family)
    layout = pc.layout(prompt)
    ref = plain_logits_at(pc.model, layout.token_ids, layout.position_ids)
    naive = pc.prefill(prompt)
    res = pc.prefill(prompt, recompute=1.0)
    assert torch.max(torch.abs(res.logits - ref)).item() <= TOL
    assert torch.max(torch.abs(naive.logits - ref)).item() > TOL, "the test prompt must drift without recompute"
    assert 0 < res.recomputed_tokens <= res.cached_tokens
    contiguous = list(layout.position_ids) == list(range(len(layout.position_ids)))
    assert res.exact == contiguous and not naive.exact


@pytest.mark.parametrize("family", FAMILIES)
def test_decoding_after_recompute_all_follows_the_plain_forward(family):
    pc = _engine(family)
    layout = pc.layout(UNIONS)
    got = pc.generate(UNIONS, max_new_tokens=4, recompute=1.0).token_ids
    ids, pos, want = list(layout.token_ids), list(layout.position_ids), []
    for _ in range(4):
        nxt = int(torch.argmax(plain_logits_at(pc.model, ids, pos)))
        want.append(nxt)
        ids, pos = ids + [nxt], pos + [pos[-1] + 1]
    assert got == want


@pytest.mark.parametrize("selection", sorted(SELECTIONS))
def test_partial_recompute_reports_its_count_and_is_not_exact(selection):
    pc = _engine("llama", selection=selection)
    full = pc.prefill(UNIONS, recompute=1.0).recomputed_tokens  # every drifted cached token
    res = pc.prefill(UNIONS, recompute=0.5)
    assert res.recomputed_tokens == round(0.5 * full) and not res.exact
    ref = plain_logits_at(pc.model, pc.layout(UNIONS).token_ids, pc.layout(UNIONS).position_ids)
    naive = pc.prefill(UNIONS)
    assert torch.max(torch.abs(res.logits - naive.logits)).item() > TOL  # it changed the state
    assert torch.max(torch.abs(res.logits - ref)).item() > TOL


def test_exact_prompts_have_nothing_to_recompute_and_the_config_applies():
    pc = _engine("llama", fraction=0.3)  # EngineConfig.recompute.fraction applies when a call passes None
    prefix = '<prompt schema="s"><a/><user>Hi</user></prompt>'
    res = pc.prefill(prefix)
    assert res.exact and res.recomputed_tokens == 0
    assert pc.prefill(UNIONS).recomputed_tokens == pc.prefill(UNIONS, recompute=0.3).recomputed_tokens > 0
    assert pc.prefill(UNIONS, recompute=0.0).recomputed_tokens == 0


def test_auto_is_the_default_exact_prompts_recompute_nothing_drifted_ones_the_budget():
    from promptcache.engine.prefill.recompute import AUTO_FRACTION

    pc = _engine("llama")
    assert pc.config.recompute.fraction == "auto"
    prefix = '<prompt schema="s"><a/><user>Hi</user></prompt>'
    exact, splice = pc.prefill(prefix), pc.prefill(prefix, recompute=0)
    assert exact.exact and exact.recomputed_tokens == 0 and torch.equal(exact.logits, splice.logits)
    for prompt in (UNIONS, GAPPED):  # drifted: unions, a module after a skipped one
        drifted = pc.prefill(prompt, recompute=1.0).recomputed_tokens  # every drifted cached token
        res, same = pc.prefill(prompt), pc.prefill(prompt, recompute=AUTO_FRACTION)
        assert res.recomputed_tokens == round(AUTO_FRACTION * drifted) > 0 and not res.exact
        assert torch.equal(res.logits, same.logits)  # "auto" is that fraction of the drifted tokens
        assert pc.prefill(prompt, recompute="AUTO").recomputed_tokens == res.recomputed_tokens
    out = pc.generate(UNIONS, max_new_tokens=2)
    assert out.recomputed_tokens == res.recomputed_tokens and not out.exact
    assert out.usage.cached_tokens == out.cached_tokens - out.recomputed_tokens  # recomputed: not served from store
    assert pc.generate(prefix, max_new_tokens=2).usage.cached_tokens == exact.cached_tokens


@pytest.mark.parametrize("bad", ["sometimes", "", None, [0.3]])
def test_bad_config_recompute_names_the_field(bad):
    from promptcache.errors import ConfigError

    with pytest.raises(ConfigError, match="RecomputeConfig.fraction .--recompute. must be 'auto' or a fraction in "
                                          "\\[0, 1\\], got"):
        RecomputeConfig(fraction=bad)
    assert RecomputeConfig(fraction=" Auto ").fraction == "auto" and RecomputeConfig(fraction=1).fraction == 1.0


@pytest.mark.parametrize("bad", [-0.1, 1.5, "0.3", True, "never"])
def test_bad_fraction_is_a_clear_error(bad):
    pc = _engine("llama")
    with pytest.raises(ValueError, match="recompute must be 'auto' or a fraction"):
        pc.prefill(UNIONS, recompute=bad)
    with pytest.raises(ValueError, match="recompute must be 'auto' or a fraction"):
        pc.generate(UNIONS, recompute=bad)


def test_unknown_selection_is_refused():
    with pytest.raises(ValueError, match="unknown recompute selection 'nope'"):
        RecomputeConfig(selection="nope")


def _request(spans_ids: list[list[int]], question: list[int], fraction: float):
    from promptcache.engine.prefill.recompute import RecomputeRequest

    ids = [t for s in spans_ids for t in s]
    spans, at = [], 0
    for s in spans_ids:
        spans.append((at, at + len(s)))
        at += len(s)
    n = len(ids)
    return RecomputeRequest(fraction=fraction, selection="qmatch", slot_order=list(range(n)), slot_ids=ids,
                            slot_pos=list(range(n)), new_order=list(range(n, n + len(question))),
                            candidates=list(range(n)), spans=spans, new_ids=question)


def test_qmatch_recomputes_the_span_that_holds_the_questions_rare_words_first():
    from promptcache.engine.prefill.recompute import match_scores, qmatch

    # 4 spans sharing the words 1, 2 ("the", "code"); only span 2 holds 7 ("green"), asked for
    spans = [[1, 2, 3, 10], [1, 2, 4, 11], [1, 2, 7, 12], [1, 2, 5, 13]]
    req = _request(spans, question=[1, 2, 7, 99], fraction=0.25)
    score = match_scores(req)
    assert score.index(max(score)) == 2 and score[0] == score[1] == score[3] < score[2]
    assert qmatch(None, req, req.budget) == [8, 9, 10, 11]  # exactly span 2
    # a larger budget: span 2 whole, then the other spans in prompt order (span 0 first), never more than k
    assert qmatch(None, req, 6) == [0, 1, 8, 9, 10, 11]
    assert qmatch(None, req, 12) == [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11]


def test_anchored_recomputes_every_spans_boundary_then_the_named_span_then_prompt_order():
    from promptcache.engine.prefill.recompute import BOUNDARY_TOKENS, anchored, epic

    assert BOUNDARY_TOKENS == 4
    # 3 spans of 8 tokens; only span 1 holds 7 (the question's rare word)
    spans = [[1, 2, 3, 10, 20, 21, 22, 23], [1, 2, 7, 11, 30, 31, 32, 33], [1, 2, 5, 12, 40, 41, 42, 43]]
    req = _request(spans, question=[1, 2, 7, 99], fraction=0.25)
    heads = [0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19]
    assert anchored(None, req, 6) == [0, 1, 2, 3, 8, 9]  # too small a budget: the first spans' boundaries
    assert anchored(None, req, 12) == heads  # every boundary first
    assert anchored(None, req, 16) == sorted(heads + [12, 13, 14, 15])  # then the named span's rest
    assert anchored(None, req, 18) == sorted(heads + [12, 13, 14, 15, 4, 5])  # then prompt order
    assert anchored(None, req, 24) == list(range(24))
    assert epic(None, req, 6) == [0, 1, 8, 9, 16, 17]  # the anchor: the budget split over the boundaries only
    assert epic(None, req, 7) == [0, 1, 2, 8, 9, 10, 16]  # a remainder: the first spans get one more


def test_qmatch_names_every_span_close_to_the_best_match_and_falls_back_to_prompt_order():
    from eval.engine_selections import qmatch_later
    from promptcache.engine.prefill.recompute import named_spans, qmatch

    # spans 1 and 3 both hold the rare word 7: both named, the later first among equals
    spans = [[1, 2, 3], [1, 7, 4], [1, 2, 5], [1, 7, 8]]
    req = _request(spans, question=[1, 7], fraction=0.5)
    assert named_spans(req) == [3, 1]
    # asked for 8 too, only span 3 holds it: span 1 scores under half of span 3's and is not named
    assert named_spans(_request(spans, question=[1, 7, 8], fraction=0.5)) == [3]
    assert qmatch(None, req, 6) == [3, 4, 5, 9, 10, 11]
    assert qmatch(None, req, 7) == [0, 3, 4, 5, 9, 10, 11]  # then span 0's first token
    assert qmatch_later(None, req, 7) == [3, 4, 5, 6, 9, 10, 11]  # the old order: then the later span 2
    # a question that matches nothing names nothing: the budget grows from the first span
    none = _request(spans, question=[42], fraction=0.5)
    assert named_spans(none) == [] and qmatch(None, none, 4) == [0, 1, 2, 3]


def test_question_attention_selections_rank_by_the_mass_past_each_spans_sink():
    from eval.engine_selections import qdoc, qnamed, qtok, span_mass

    spans = [[1, 2, 3, 4], [1, 7, 5, 6], [1, 2, 8, 9]]
    req = _request(spans, question=[7, 99], fraction=0.5)
    scores = torch.tensor([9.0, 0, 0, 0,  5.0, 0, 1, 0,  9.0, 0, 0, 3])  # the sinks (slots 0, 4, 8) draw most
    assert span_mass(scores, req) == [0.0, 1.0, 3.0]  # each span's first token left out
    assert qdoc(scores, req, 6) == [4, 5, 8, 9, 10, 11]  # span 2, then span 1's first tokens
    assert qnamed(scores, req, 6) == [4, 5, 6, 7, 8, 9]  # the named span 1 (it holds 7), then span 2
    assert qtok(scores, req, 2) == [10, 11]  # slot 11 (3.0) and its neighbour 10 (12 is no candidate)
    assert qtok(scores, req, 5) == [5, 6, 7, 10, 11]  # then slot 6 (1.0) with 5 and 7
    assert qtok(None, req, 4) == qnamed(None, req, 4)  # no attention (a backend without it): qmatch


def test_qmatch_through_the_engine_picks_the_union_the_question_names():
    from promptcache.engine.prefill.recompute import qmatch, recompute_request

    pc = _engine("llama", selection="qmatch")
    layout = pc.layout(UNIONS)  # "Which city has temples?": only module b mentions temples
    req = recompute_request(layout, 0, 0.3, "qmatch", False)
    slot, b = 0, None
    for s in (s for s in layout.spans if s.kind == "cached"):
        if s.name.endswith("b"):
            b = list(range(slot, slot + len(s)))
        slot += len(s)
    assert qmatch(None, req, len(b)) == b
    res = pc.prefill(UNIONS, recompute=0.3)
    assert 0 < res.recomputed_tokens <= res.cached_tokens and not res.exact


def test_a_registered_selection_is_a_config_name_and_a_taken_name_is_refused():
    assert {"qattn_mix", "qmatch_later"} <= set(SELECTIONS)  # eval/engine_selections.py registered them
    assert RecomputeConfig(selection="qmatch_later").selection == "qmatch_later"
    register_selection("qmatch_later", engine_selections.qmatch_later)  # the same function again: no-op
    with pytest.raises(ValueError, match="already registered"):
        register_selection("qmatch", engine_selections.qmatch_later)
    with pytest.raises(ValueError, match="scores_from"):
        register_selection("study_x", engine_selections.qattn_mix, scores_from=1.5)
    assert "study_x" not in SELECTIONS
