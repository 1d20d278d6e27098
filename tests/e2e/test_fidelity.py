"""eval/fidelity.py: the answer's definition, the statistics on hand-made rows, the prompts, and
the study end to end on a tiny random model. No assertion here looks at wall time."""

from __future__ import annotations

import csv
import math
import re

import pytest

from eval import fidelity, fidelity_tasks, kept_share


def test_the_answer_is_the_first_line_up_to_its_first_sentence_end():
    assert fidelity.answer_text("The code is 6729. The access") == "The code is 6729"
    assert fidelity.answer_text("The code is 6729") == "The code is 6729"  # stopped by the engine's ". "
    assert fidelity.answer_text(" 6729\nNote 2.") == "6729"
    assert fidelity.answer_text("It is 67.29 or so") == "It is 67.29 or so"  # a point inside a number ends nothing
    assert fidelity.answer_text("Really? Yes") == "Really"
    assert fidelity.answer_done("6729. ") and fidelity.answer_done("6729\n")
    assert not fidelity.answer_done("The code is 6729.")  # a point at the end may still be a decimal point


def test_answers_agree_on_the_code_they_give():
    key = fidelity.answer_key
    assert key("The code is 4677") == key("The locker code of the person is 46 77") == "4677"
    assert key("The code is 4232") != key("The code is 4677")
    assert key("The parcel is for the person at the library") == key("the parcel is for the person at the library")
    assert key("Lisbon") == key("Kofi lives in Lisbon") == "lisbon" != key("Kofi lives in Oslo")  # the fact tasks' city
    assert key("The city is Paris") == key("The city name is Paris") != key("The city name is Goran")  # a name given
    assert key("The city is not specified") == "the city is not specified"
    r = fidelity.score(dict(full_answer="The code is 4677", method_answer="It is 4677"))
    assert (r["agree"], r["agree_text"]) == (1, 0)


class Letters:
    """A tokenizer stand-in: a token is one character."""

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(i) for i in ids)


def test_the_answers_margin_is_the_step_that_starts_its_key():
    import torch

    assert math.isclose(fidelity.margin(torch.tensor([0.0, math.log(3.0), -1e9])), 0.5, abs_tol=1e-6)  # 3/4 - 1/4
    gen = [ord(c) for c in "It is Oslo. "]
    margins = [0.9] * len(gen)
    margins[6] = 0.1  # the step that writes the "O" of Oslo
    assert fidelity.answer_margin(Letters(), gen, margins) == 0.1
    gen = [ord(c) for c in "No idea. "]  # no key: the first step's
    assert fidelity.answer_margin(Letters(), gen, [0.3] + [0.9] * (len(gen) - 1)) == 0.3


def test_the_confident_stratum_keeps_prompts_where_full_prefill_was_sure():
    rows = [dict(row(f"s{i}", "listed", "default", 0.2, agree, 1, agree), full_margin=m)
            for i, (agree, m) in enumerate([(1, 0.9), (1, 0.7), (0, 0.2), (0, 0.1)])]
    sure = next(s for s in fidelity.summarize(rows, min_margin=0.5) if s["order"] == "confident")
    assert (sure["prompts"], sure["agreement"], sure["min_margin"]) == (2, 1.0, 0.5)
    both = next(s for s in fidelity.summarize(rows, min_margin=0.5) if s["order"] == "both")
    assert (both["prompts"], both["agreement"], both["min_margin"]) == (4, 0.5, None)
    table = {t["min_margin"]: t for t in fidelity.by_margin(rows, (0.0, 0.5, 0.8))}
    assert (table[0.0]["prompts"], table[0.0]["agreement"]) == (4, 0.5)
    assert (table[0.5]["prompts"], table[0.5]["agreement"], table[0.5]["share"]) == (2, 1.0, 0.5)
    assert (table[0.8]["prompts"], table[0.8]["agreement"]) == (1, 1.0)
    assert "| single | default | 0.20 | 0.50 (4) | 1.00 (2) | 1.00 (1) |" in fidelity.margin_markdown(list(table.values()))
    old = [{k: v for k, v in r.items() if k != "full_margin"} for r in rows]  # an older run's rows: no stratum
    assert {s["order"] for s in fidelity.summarize(old)} == {"listed", "both"}


def test_wilson_interval_on_known_values():
    lo, hi = fidelity.wilson(9, 10)
    assert (round(lo, 4), round(hi, 4)) == (0.5958, 0.9821)
    assert fidelity.wilson(0, 5)[0] == 0.0 and fidelity.wilson(5, 5)[1] == 1.0


def row(sample, order, method, budget, agree, full, got, kl=0.1, speedup=4.0):
    return dict(task="single", sample=sample, order=order, method=method, budget=budget, agree=agree, agree_text=agree,
                full_correct=full, method_correct=got, first_token_kl=kl, recomputed=budget, speedup=speedup, load=1.0)


def test_summary_counts_agreement_lost_and_won_per_order():
    # 6 prompts: 4 agree; of the 2 that differ one answer is lost, one changes between two wrong ones
    outcomes = [(1, 1, 1), (1, 1, 1), (1, 0, 0), (1, 0, 0), (0, 1, 0), (0, 0, 0)]
    rows = [row(f"s{i}", "listed" if i % 2 == 0 else "shuffled", "default", 0.2, *o) for i, o in enumerate(outcomes)]
    both = next(s for s in fidelity.summarize(rows) if s["order"] == "both")
    assert (both["prompts"], both["agreement"], both["lost"], both["won"]) == (6, round(4 / 6, 4), 1, 0)
    assert both["full_accuracy"] == 0.5 and both["method_accuracy"] == round(2 / 6, 4)
    assert both["kept"] == round(2 / 3, 4) and both["mcnemar_p"] == kept_share.mcnemar_p(1, 0) == 1.0
    assert both["kept_low"] <= both["kept"] <= both["kept_high"]
    listed = next(s for s in fidelity.summarize(rows) if s["order"] == "listed")
    assert listed["prompts"] == 3 and listed["agreement"] == round(2 / 3, 4)  # s0, s2 agree; s4 does not


def test_methods_pair_with_one_on_the_same_prompts_at_the_same_budget():
    # 5 prompts: the default agrees on s0-s2, the method on s1-s4; s9 has no default row (not paired)
    rows = [row(f"s{i}", "listed", "default", 0.2, int(i < 3), 1, 1, speedup=5.0) for i in range(5)]
    rows += [row(f"s{i}", "listed", "fast", 0.2, int(i >= 1), 1, 1, speedup=s) for i, s in
             zip((0, 1, 2, 3, 4, 9), (4.0, 4.0, 5.0, 6.0, 6.0, 1.0))]
    rows += [row("s0", "listed", "fast", 0.15, 1, 1, 1)]  # no default at 0.15: nothing to pair
    (q,) = fidelity.paired(rows, "default")
    assert (q["method"], q["budget"], q["prompts"], q["both"], q["against_only"], q["method_only"]) == \
        ("fast", 0.2, 5, 2, 1, 2)
    assert q["mcnemar_p"] == kept_share.mcnemar_p(1, 2) and q["method_ttft_x"] == 5.0 and q["against_ttft_x"] == 5.0
    assert (q["method_agreement"], q["against_agreement"]) == (0.8, 0.6)


def test_shared_ends_stand_for_every_method_they_equal():
    """The splice (budget 0) is every selection without a key scale; APE scales keys even at 0
    and the CacheBlend reference reuses another state, so they run their own."""
    runs = fidelity.runs_for(["default", "ape", "cacheblend"], [0.0, 0.1, 1.0])
    assert [(m, b) for m, b, _ in runs] == [("splice", 0.0), ("default", 0.1), ("ape", 0.0), ("ape", 0.1),
                                            ("cacheblend", 0.0), ("cacheblend", 0.1), ("full_recompute", 1.0)]
    rows = [row("s0", "listed", "splice", 0.0, 1, 1, 1), row("s0", "listed", "full_recompute", 1.0, 1, 1, 1),
            row("s0", "listed", "ape", 0.0, 0, 1, 0)]
    out = fidelity.expand_shared(rows, ["default", "ape", "cacheblend"])
    assert sorted((r["method"], r["budget"]) for r in out) == [
        ("ape", 0.0), ("ape", 1.0), ("cacheblend", 1.0), ("default", 0.0), ("default", 1.0)]
    runs = fidelity.runs_for(["default", "epic"], [0.0, 0.1], default_budgets=[0.5, 0.1])  # the default's more
    assert [(m, b) for m, b, _ in runs] == [("splice", 0.0), ("default", 0.1), ("default", 0.5), ("epic", 0.1)]
    runs = fidelity.runs_for(["system:default", "system:epic"], [0.1], default_budgets=[0.5])  # any encoding's
    assert [(m, b) for m, b, _ in runs] == [("system:default", 0.1), ("system:default", 0.5), ("system:epic", 0.1)]
    # documents encoded after the prompts' prefix (system:M) are another splice, run once as
    # system:default's budget 0 and drawn for the encoding's other methods but a key-scaled one
    runs = fidelity.runs_for(["default", "system:default", "system:prophet", "system:ape"], [0.0, 0.1])
    assert [(m, b, sel) for m, b, sel in runs] == [
        ("splice", 0.0, None), ("default", 0.1, None), ("system:default", 0.0, "system:"),
        ("system:default", 0.1, "system:"), ("system:prophet", 0.1, "system:qattn"),
        ("system:ape", 0.0, "system:ape"), ("system:ape", 0.1, "system:ape")]
    rows = [row("s0", "listed", "splice", 0.0, 1, 1, 1), row("s0", "listed", "system:default", 0.0, 0, 1, 0),
            row("s0", "listed", "system:ape", 0.0, 1, 1, 1), row("s1", "listed", "system:default", 0.0, 1, 1, 1),
            row("s1", "listed", "system:prophet", 0.0, 0, 1, 0)]  # a method's own row (an older run's) wins
    out = fidelity.expand_shared(rows, ["default", "system:default", "system:prophet", "system:ape"])
    got = sorted((r["sample"], r["method"], r["agree"]) for r in out)
    assert got == [("s0", "default", 1), ("s0", "system:ape", 1), ("s0", "system:default", 0),
                   ("s0", "system:prophet", 0), ("s1", "system:default", 1), ("s1", "system:prophet", 0)]
    runs = fidelity.runs_for(["system:prophet"], [0.0])  # no system:default to stand for it: its own
    assert [(m, b) for m, b, _ in runs] == [("system:prophet", 0.0)]
    assert fidelity.split_method("system:default") == ("system", "default")
    assert fidelity.split_method("qattn") == (fidelity.DEFAULT_ENCODING, "qattn")  # the store's default encoding
    assert fidelity.split_method("alone:default") == ("alone", "default")  # the default before issue 51
    assert fidelity.selection_of("alone:default") == "alone:" and fidelity.selection_of("prophet") == "qattn"


@pytest.mark.parametrize("task", fidelity_tasks.TASKS)
def test_tasks_are_seeded_and_answerable(task):
    a = fidelity_tasks.samples(task, 8)
    assert a == fidelity_tasks.samples(task, 8) and a != fidelity_tasks.samples(task, 8, seed=52)
    for s in a:
        notes, code = s["notes"], s["answers"][0]
        assert len(notes) in fidelity_tasks.DOC_COUNTS
        assert [code in n for n in notes].count(True) == 1 and code in notes[s["target"]]
        assert 700 < len(" ".join(notes).split()) * 4 / 3 < 1400  # ~1K tokens at ~4/3 tokens a word
        if task == "fact2":  # the question names no person; the memo names the target's
            memo = next(n for n in notes if n.startswith("Delivery memo."))
            name = re.search(r"The parcel is for (\w+)\.", memo).group(1)
            assert notes[s["target"]].startswith(f"About {name}.") and name not in s["input"]
        if task.startswith("fact"):  # distinct facts: a city named once, in its person's record, nowhere else
            words = re.findall(r"\w+", " ".join(notes).lower())
            cities = [w for w in words if w in fidelity_tasks.ANSWER_WORDS]
            assert len(cities) == len(set(cities)) == sum(n.startswith("About ") for n in notes)
        if task == "twohop":  # the question names no place; the memo names the target's
            memo = next(n for n in notes if n.startswith("Delivery memo."))
            place = re.search(r"works at the (\w+)\.", memo).group(1)
            assert f"works at the {place}." in notes[s["target"]] and place not in s["input"]
    with pytest.raises(ValueError, match="unknown fidelity task 'x'"):
        fidelity_tasks.samples("x", 1)


def test_study_end_to_end_on_a_tiny_model(tmp_path):
    summary = fidelity.main(["--model", "embedded:demo", "--n", "1", "--methods", "default", "cacheblend",
                             "system:default", "alone:default", "--budgets", "0",
                             "0.2", "1", "--doc-tokens", "160", "--answer-tokens", "4", "--calibrate", "1",
                             "--out", str(tmp_path), "--tag", "_t"])
    with open(tmp_path / "fidelity_t.csv") as f:
        rows = list(csv.DictReader(f))
    # 2 tasks x 2 orders x (splice, default@0.2, cacheblend@0 and @0.2, system:default@0 and @0.2,
    # alone:default@0 and @0.2, full_recompute, bf16_full)
    assert len(rows) == 40 and {r["order"] for r in rows} == {"listed", "shuffled"}
    for r in rows:
        if r["method"] == "full_recompute":  # every document token recomputed: a plain prefill
            assert r["exact"] == "1" and r["agree"] == "1" and float(r["first_token_kl"]) < 1e-6
        if r["method"] in ("splice", "default", "cacheblend", "alone:default"):
            # documents encoded alone, or after a prefix that is not the prompt's (the store has no system text), drift
            assert r["exact"] == "0" and float(r["first_token_kl"]) > 0
        if r["method"] in ("default", "alone:default") and float(r["budget"]) > 0:
            assert math.isclose(float(r["recomputed"]), 0.2, abs_tol=0.02)
        if r["method"] == "system:default":  # the first document is exact: 20% of the others' tokens
            assert r["exact"] == "0" and 0 < float(r["recomputed"]) < 0.2 or float(r["budget"]) == 0
    assert {(s["method"], s["budget"]) for s in summary} >= {("default", 0.0), ("cacheblend", 1.0), ("bf16_full", 1.0)}
    assert all(0.0 <= float(r["full_margin"]) <= 1.0 for r in rows)
    for name in ("fidelity_t_summary.csv", "fidelity_t_summary.png", "fidelity_t_ttft.png", "fidelity_t_margin.csv"):
        assert (tmp_path / name).exists()
    again = fidelity.main(["--combine", str(tmp_path / "fidelity_t.csv"), "--methods", "default", "cacheblend",
                           "system:default", "alone:default", "--out", str(tmp_path), "--tag", "_c"])
    assert again == summary


def test_a_refresh_during_decoding_of_exact_states_changes_nothing(tmp_path):
    """KVShare-style refresh (eval/fidelity_kvshare.py): on a prompt prefilled exactly (every
    document token recomputed), recomputing every document token again in prompt order after the
    first answer token gives the same next-token logits as plain decoding; on a splice it moves them."""
    import torch

    from eval import fidelity_kvshare
    from promptcache import PromptCache

    pc = PromptCache.from_pretrained("embedded:demo")
    sample = fidelity_tasks.samples("fact1", 1, doc_tokens=160)[0]
    p = fidelity.Prompt(pc, sample, shuffled=True)
    got = {}
    for budget in (1.0, 0.0):
        for share in (None, 1.0):
            res = p.store(None).prefill(p.question, p.ids, system=fidelity.SYSTEM, recompute=budget, reserve=4,
                                        keep_cache=True)
            first = int(res.logits.argmax())
            with torch.inference_mode():
                got[(budget, share)] = (pc.adapter.forward(torch.tensor([[first]]), torch.tensor([[res.next_position]]),
                                                           res.cache)[0] if share is None else
                                        fidelity_kvshare.refresh(pc, res, first, share)).float()
            pc.release(res)
    assert torch.allclose(got[(1.0, None)], got[(1.0, 1.0)], atol=1e-4)
    assert not torch.allclose(got[(0.0, None)], got[(0.0, 1.0)], atol=1e-4)
    order, _, _, docs, new_order = fidelity_kvshare.slot_map(p.store(None).layout(p.question, p.ids, system=fidelity.SYSTEM))
    assert sorted(order + new_order) == list(range(len(order) + len(new_order))) and set(docs) <= set(range(len(order)))
    rows = fidelity.main(["--model", "embedded:demo", "--n", "1", "--tasks", "fact1", "--orders", "listed",
                          "--methods", "kvshare", "--budgets", "0.2", "--doc-tokens", "160", "--answer-tokens", "4",
                          "--out", str(tmp_path)])
    assert any(s["method"] == "kvshare" and s["budget"] == 0.2 for s in rows)


def test_a_base_model_gets_the_completion_format():
    """Without a chat template the study's prompts are plain text a base model continues with the
    answer: the examples, the documents, "Question: ...?" and "\\nAnswer:" (no role headers, no
    answer instruction); with one, the chat format as before."""
    from promptcache import PromptCache

    pc = PromptCache.from_pretrained("embedded:demo")
    assert fidelity.default_format(pc.tokenizer) == "chat"
    sample = fidelity_tasks.samples("fact1", 1, doc_tokens=160)[0]
    chat = fidelity.Prompt(pc, sample, shuffled=False)
    assert chat.system == fidelity.SYSTEM and chat.question.endswith("Answer with the city name only.")
    pc.tokenizer.chat_template = None
    assert fidelity.default_format(pc.tokenizer) == "completion"
    pc = PromptCache.from_pretrained("embedded:demo")  # a fresh span tokenizer: it keeps what it rendered
    assert fidelity.use_format(pc, "completion") == fidelity.COMPLETION_SYSTEM
    p = fidelity.Prompt(pc, sample, shuffled=False, fmt="completion")
    name = re.search(r"does (\w+) live", sample["input"]).group(1)
    text = pc.tokenizer.decode(p.token_ids(), skip_special_tokens=True)
    expected = (fidelity.COMPLETION_SYSTEM + "\n\n" + "\n\n".join(sample["notes"]) + "\n\n"
                + f"Question: In which city does {name} live?\nAnswer:")
    assert "".join(text.split()) == "".join(expected.split())  # the tiny tokenizer drops newlines
    assert "System:" not in text and "Assistant" not in text
    with pytest.raises(ValueError, match="--format: unknown 'x'"):
        fidelity.use_format(pc, "x")


def test_question_pass_cost_times_every_pass_and_the_full_pass_overlaps_itself(tmp_path):
    from eval import question_pass_cost

    rows = question_pass_cost.main(["--model", "embedded:demo", "--prompts", "1", "--repeats", "1",
                                    "--out", str(tmp_path), "--tag", "_t"])
    assert {r["what"] for r in rows} == {"splice", "eager_all", *question_pass_cost.PASSES}
    assert len(rows) == 2 * (2 + len(question_pass_cost.PASSES))  # fact1 and fact2, one sample each
    for r in rows:
        assert r["seconds"] > 0 and r["new_tokens"] > 0
        if r["what"] == "pass_all":
            assert r["overlap"] == 1.0  # every layer's choice is itself
        elif r["what"] in question_pass_cost.PASSES:
            assert 0.0 <= r["overlap"] <= 1.0
    assert (tmp_path / "question_pass_cost_t.csv").exists() and (tmp_path / "question_pass_cost_t.png").exists()
