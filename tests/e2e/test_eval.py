"""Evaluation suite: metrics on hand-made examples, and each study end to end on a tiny model.

No assertion here looks at wall time.
"""

from __future__ import annotations

import csv
import json
import math
import re
from pathlib import Path

import pytest
import torch

from eval import accuracy, memory, metrics, ttft
from eval.data import make_synthetic
from tiny import make_model, make_tokenizer


def read_csv(path: Path) -> list[dict]:
    with path.open() as f:
        return list(csv.DictReader(f))


# -- metrics ---------------------------------------------------------------------------------------
def test_normalize_drops_case_punctuation_articles():
    assert metrics.normalize_answer("  The Cat, and   an Owl!  ") == "cat and owl"
    assert metrics.normalize_answer("A") == ""


def test_f1_on_hand_made_examples():
    assert metrics.f1_score("The cat sat.", "cat sat down") == pytest.approx(0.8)  # P 2/2, R 2/3
    assert metrics.f1_score("cat cat", "cat") == pytest.approx(2 / 3)  # P 1/2, R 1/1
    assert metrics.f1_score("Paris", "paris!") == 1.0
    assert metrics.f1_score("dog", "cat") == 0.0
    assert metrics.f1_score("", "cat") == 0.0


def test_lcs_and_rouge_l():
    assert metrics.lcs_length("ABCBDAB", "BDCABA") == 4
    assert metrics.lcs_length([], [1, 2]) == 0
    # police killed gunman vs gunman police killed: LCS "police killed" = 2 of 3 each way
    assert metrics.rouge_l("police killed the gunman", "the gunman police killed") == pytest.approx(2 / 3)
    # LCS 3 ("x y z"), P 3/5, R 3/3 -> F 0.75
    assert metrics.rouge_l("x q y r z", "x y z") == pytest.approx(0.75)
    assert metrics.rouge_l("same words", "Same words.") == 1.0
    assert metrics.rouge_l("", "x") == 0.0


def test_exact_match_and_task_scores():
    assert metrics.exact_match("The Answer.", "answer") == 1.0
    assert metrics.exact_match("answers", "answer") == 0.0
    assert metrics.metric_for("hotpotqa") == "f1"
    assert metrics.metric_for("gov_report_e") == "rouge_l"
    assert metrics.metric_for("trec") == "exact_match"
    assert metrics.metric_for("synthetic_summary") == "rouge_l"
    assert metrics.metric_for("synthetic_classify") == "exact_match"
    assert metrics.metric_for("anything") == "f1"
    assert metrics.task_score("synthetic_qa", "It is 4821", ["1234", "4821"]) == pytest.approx(0.5)  # P 1/3, R 1
    assert metrics.task_score("trec", "\nSports\nmore text", ["sports"]) == 1.0  # first line only
    assert metrics.task_score("qa", "x", []) == 0.0


def test_kl_divergence():
    p = torch.log(torch.tensor([0.5, 0.5], dtype=torch.float64))
    q = torch.log(torch.tensor([0.9, 0.1], dtype=torch.float64))
    expected = 0.5 * math.log(0.5 / 0.9) + 0.5 * math.log(0.5 / 0.1)
    assert metrics.kl_divergence(p, q) == pytest.approx(expected, rel=1e-9)
    assert metrics.kl_divergence(p + 3.0, q - 1.0) == pytest.approx(expected, rel=1e-9)  # logits, not probs
    x = torch.randn(100)
    assert metrics.kl_divergence(x, x) == 0.0
    assert metrics.kl_divergence(x, torch.randn(100)) > 0


def test_token_agreement():
    assert metrics.token_agreement([1, 2, 3, 4], [1, 2, 9, 4]) == 0.5  # equal after a divergence don't count
    assert metrics.token_agreement([1, 2], [1, 2, 3, 4]) == 0.5
    assert metrics.token_agreement([5, 6, 7], [5, 6, 7]) == 1.0
    assert metrics.token_agreement([], []) == 1.0
    assert metrics.token_agreement([1], []) == 0.0


def test_loglog_slope_recovers_known_exponents():
    xs = [512, 1024, 2048, 4096, 8192]
    assert metrics.loglog_slope(xs, [3e-4 * x**1.7 for x in xs]) == pytest.approx(1.7)
    assert metrics.loglog_slope(xs, [5 * x for x in xs]) == pytest.approx(1.0)
    mixed = [1e-3 * x + 1e-7 * x * x for x in xs]  # linear + quadratic: between 1 and 2, growing
    assert 1.0 < metrics.loglog_slope(xs[:2], mixed[:2]) < metrics.loglog_slope(xs[-2:], mixed[-2:]) < 2.0
    with pytest.raises(ValueError):
        metrics.loglog_slope([1], [1])
    with pytest.raises(ValueError):
        metrics.loglog_slope([2, 2], [1, 3])


# -- TTFT pieces -----------------------------------------------------------------------------------
def test_prefix_store_reuses_longest_common_prefix_exactly():
    model = make_model("llama")
    store = ttft.PrefixStore(model)
    old = list(range(10, 40))
    store.store(old)
    new = old[:12] + [77, 78] + old[14:] + [5, 6]
    logits, reused = store.prefill(new)
    assert reused == 12
    with torch.inference_mode():
        ref = model(input_ids=torch.tensor([new])).logits[0, -1]
    torch.testing.assert_close(logits, ref, atol=1e-5, rtol=1e-5)
    assert store.prefill(old)[1] == len(old) - 1  # the last token is always run
    logits, reused = store.prefill(old[:8])
    assert reused == 7
    with torch.inference_mode():
        torch.testing.assert_close(logits, model(input_ids=torch.tensor([old[:8]])).logits[0, -1], atol=1e-5,
                                   rtol=1e-5)
    assert len(store.kv[0][0][0, 0]) == len(old)  # the stored prefix is never cut


def test_ttft_case_has_the_asked_cached_fraction_and_changes_an_early_module():
    from promptcache import PromptCache

    tok = make_tokenizer(chat=False)
    pc = PromptCache(make_model("llama"), tok)
    case = ttft.build_case(tok, 200, [0.5, 0.9], change_at=0.05, module_tokens=40)
    pc.add_schema(case.schema)
    previous = pc.layout(case.previous).token_ids
    for f, prompt in case.prompts.items():
        res = pc.prefill(prompt)
        total = res.cached_tokens + res.new_tokens
        assert abs(total - 200) <= 12 and abs(res.cached_tokens / total - f) < 0.05, (f, res)
        ids = pc.layout(prompt).token_ids
        common = next(i for i, (a, b) in enumerate(zip(ids, previous)) if a != b)
        assert common <= 0.05 * 200 + 3  # prefix reuse gets the preamble only
    with pytest.raises(ValueError, match="cached fraction 0.01"):
        ttft.build_case(tok, 200, [0.01], change_at=0.05, module_tokens=40)


# -- studies end to end ----------------------------------------------------------------------------
def test_ttft_study_end_to_end(tmp_path):
    rows = ttft.main(["--quick", "--model", "embedded:demo", "--repeats", "1", "--out", str(tmp_path)])
    got = read_csv(tmp_path / "ttft.csv")
    assert len(got) == len(rows)
    methods = {r["method"] for r in got}
    assert {"full", "prefix", "pc_device", "pc_device_inplace", "limit"} <= methods
    assert {(int(r["length"]), float(r["fraction"])) for r in got} == {(64, 0.5), (64, 0.9), (128, 0.5), (128, 0.9)}
    for r in got:
        assert float(r["ttft_s"]) > 0
        assert float(r["prefix_logits_maxdiff"]) < 1e-3  # prefix reuse computes what full prefill does
        assert int(r["prefix_reused_tokens"]) < int(r["cached_tokens"])
    fits = read_csv(tmp_path / "ttft_exponents.csv")
    assert {r["method"] for r in fits} == methods
    pytest.importorskip("matplotlib")
    assert (tmp_path / "ttft.png").stat().st_size > 0


def test_memory_study_end_to_end(tmp_path):
    per_token, peaks = memory.main(["--model", "embedded:demo", "--tokens", "48", "--config-tokens", "12",
                                    "--out", str(tmp_path)])
    measured = [r for r in per_token if r["measured_bytes_per_token"] != ""]
    assert {r["attention"] for r in measured} == {"MHA", "GQA", "MQA"}
    assert {r["dtype"] for r in measured} >= {"float32", "float16", "bfloat16"}
    for r in measured:
        assert r["measured_bytes_per_token"] == r["theory_bytes_per_token"], r
    by_name = {(r["model"], r["dtype"]): r for r in per_token}
    assert by_name[("Llama-2-7B", "float16")]["theory_bytes_per_token"] == 2 * 32 * 32 * 128 * 2
    assert by_name[("Falcon-7B", "bfloat16")]["theory_bytes_per_token"] == 2 * 32 * 1 * 64 * 2
    assert read_csv(tmp_path / "memory_bytes_per_token.csv")
    rows = read_csv(tmp_path / "memory_peaks.csv")
    artifact = rows[-1]
    assert artifact["phase"] == "artifact on disk" and float(artifact["disk_mib"]) >= float(artifact["kv_mib"])


def _jsonl(tmp_path: Path) -> Path:
    samples = [
        dict(context="The red door code is 4821. Ravens sing.\n\nThe blue door code is 1234.\n\nFish swim fast.",
             input="What is the red door code?", answers=["4821"], dataset="synthetic_qa", _id="a"),
        dict(context="Alice opened a bakery in Oslo.\n\nBob walked to the harbour.", input="What did Alice do?",
             answers=["Alice opened a bakery in Oslo."], task="gov_report"),
    ]
    path = tmp_path / "data.jsonl"
    path.write_text("".join(json.dumps(s) + "\n" for s in samples))
    return path


@pytest.mark.parametrize("mode", ["independent", "chained"])
def test_accuracy_study_end_to_end(tmp_path, mode):
    data = _jsonl(tmp_path)
    rows, summary = accuracy.main(["--model", "embedded:demo", "--data", str(data), "--mode", mode,
                                   "--module-tokens", "12", "--max-new-tokens", "4", "--out", str(tmp_path)])
    assert [r["metric"] for r in rows] == ["f1", "rouge_l"]
    assert all(r["modules"] >= 2 for r in rows)
    assert summary[-1]["task"] == "all" and summary[-1]["samples"] == 2
    assert read_csv(tmp_path / f"accuracy_{mode}_m12.csv")
    assert read_csv(tmp_path / f"accuracy_{mode}_m12_summary.csv")[-1]["model"] == "embedded:demo"
    for r in rows:
        assert 0 <= r["token_agreement"] <= 1 and 0 <= r["score_pc"] <= 1 and r["first_token_kl"] >= 0
        if mode == "chained":  # every module imported in order: exactly a full prefill
            assert r["exact_state"] and r["first_token_kl"] < 1e-6 and r["output_exact"] == 1
        else:  # modules encoded apart: the state differs from a full prefill
            assert not r["exact_state"] and r["first_token_kl"] > 0


def test_split_modules_packs_paragraphs():
    tok = make_tokenizer()
    paras = [f"Paris is the capital of France number {i}." for i in range(6)]
    context = "\n\n".join(paras)
    per = max(len(tok.encode(p, add_special_tokens=False)) for p in paras)
    chunks = accuracy.split_modules(tok, context, module_tokens=2 * per)
    assert "\n\n".join(chunks) == context
    assert len(chunks) == 3  # two paragraphs per module
    long = "Paris is big. Tokyo is huge. Rome is old. " * 8  # one paragraph: split at sentences
    assert len(accuracy.split_modules(tok, long, module_tokens=2 * per)) > 1


def test_memo_samples_need_the_memo_to_find_the_record():
    """Two hops: the question names neither person nor place; the memo names the place of the
    answer's record, and no other record works there."""
    a = make_synthetic.memo_samples(6, seed=3)
    assert a == make_synthetic.memo_samples(6, seed=3) and a != make_synthetic.memo_samples(6, seed=4)
    for s in a:
        *records, memo = s["notes"]
        assert len(records) == 3 and memo.startswith("Delivery memo.")
        place = re.search(r"works at the (\w+)\.", memo).group(1)
        holders = [r for r in records if f"works at the {place}." in r]
        assert holders == [records[s["target"]]] and s["answer"] in holders[0]
        assert place not in s["input"] and not any(n in s["input"] for n in make_synthetic.NAMES)
        assert sum(s["answer"] in r for r in records) == 1


def test_synthetic_data_is_deterministic_and_answerable(tmp_path):
    a, b = make_synthetic.generate(samples=2), make_synthetic.generate(samples=2)
    assert a == b and len(a) == 6
    for s in a:
        if s["dataset"] != "synthetic_classify":
            assert s["answers"][0] in s["context"]
        assert s["context"].count("\n\n") == 7
    path = make_synthetic.main(["--out", str(tmp_path / "s.jsonl"), "--samples", "1"])
    assert accuracy.read_jsonl(path) == make_synthetic.generate(samples=1)
