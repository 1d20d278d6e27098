"""The quality studies end to end on the embedded random-weight model (smoke + the checks that
must hold whatever the weights): the retrieval study split and combined, the examples check.

No assertion here looks at wall time; accuracy figures of random weights mean nothing.
"""

from __future__ import annotations

from pathlib import Path

import pytest


EVAL = Path(__file__).resolve().parents[2] / "eval"
from eval import accuracy, examples_check

pytestmark = pytest.mark.slow


def test_retrieval_study_split_runs_combine_to_the_whole(tmp_path):
    common = ["--model", "embedded:demo", "--task", "retrieval", "--recompute", "1.0", "--max-new-tokens", "3",
              "--modes", "independent", "docstore_exact", "--threads", "1"]
    whole, _ = accuracy.main(common + ["--limit", "2", "--out", str(tmp_path / "whole")])
    accuracy.main(common + ["--limit", "1", "--out", str(tmp_path / "a")])
    accuracy.main(common + ["--first", "1", "--limit", "1", "--out", str(tmp_path / "b")])
    rows, summary = accuracy.main(["--model", "embedded:demo", "--task", "retrieval", "--out", str(tmp_path / "c"),
                                   "--combine", str(tmp_path / "a" / "accuracy_retrieval.csv"),
                                   str(tmp_path / "b" / "accuracy_retrieval.csv")])
    key = lambda r: (r["sample"], r["mode"], r["shuffled"], str(r["recompute"]))  # noqa: E731
    assert sorted(map(key, rows)) == sorted(map(key, whole))  # same samples and shuffles however split
    assert {r["output_pc"] for r in rows} == {r["output_pc"] for r in whole}
    # recompute=1.0 equals a plain forward, and chains are exact: promptcache answers as full prefill does
    for r in rows:
        if r["recompute"] == 1.0 or r["mode"] == "docstore_exact":
            assert r["output_pc"] == r["output_full"] and r["pc_correct"] == r["full_correct"], r
    assert (tmp_path / "c" / "accuracy_retrieval_summary.csv").is_file()
    assert {s["mode"] for s in summary} == {"independent", "docstore_exact"}


def test_examples_check_covers_every_example_and_full_recompute_matches(tmp_path):
    rows = examples_check.main(["--model", "embedded:demo", "--max-new-tokens", "3", "--recompute", "1.0",
                                "--out", str(tmp_path)])
    names = {p.name for p, _ in examples_check.examples(EVAL.parent / "examples")}
    assert {r["example"] for r in rows} == names and len(names) >= 10
    for r in rows:  # (recompute=1.0 is a plain forward at the layout's positions, which may have gaps:
        # not the contiguous baseline, so its text may differ; nothing is asserted about it)
        assert r["same_text"] == int(r["token_agreement"] == 1.0) and r["first_token_kl"] >= -1e-9, r
    assert {r["recompute"] for r in rows} == {"auto", 1.0}
    assert (tmp_path / "examples_check.csv").is_file()


def test_memo_task_runs_the_default_beside_named_anchors(tmp_path):
    """The second task (``--task memo``) through the retrieval study with ``--anchors``: an anchor
    recomputing everything (``qmatch@1.0``) answers as full prefill does; ``qmatch@0`` (the splice)
    recomputes nothing; an unknown anchor is refused naming the known ones."""
    rows, summary = accuracy.main(["--model", "embedded:demo", "--task", "memo", "--modes", "docstore_default",
                                   "--anchors", "qmatch@1.0", "qmatch@0", "--recompute", "--limit", "2",
                                   "--max-new-tokens", "3", "--threads", "1", "--out", str(tmp_path)])
    assert {r["recompute"] for r in rows} == {"auto", "qmatch@1.0", "qmatch@0"}
    assert len(rows) == 2 * 2 * 3  # samples x (in order, shuffled) x (default + 2 anchors)
    for r in rows:
        if r["recompute"] == "qmatch@1.0":
            # every document recomputed (the prefix was exact already: a share of the cached tokens below 1)
            assert r["output_pc"] == r["output_full"] and r["first_token_kl"] < 1e-6 and r["recomputed"] > 0.5, r
        if r["recompute"] == "qmatch@0":
            assert r["recomputed"] == 0.0
    assert (tmp_path / "accuracy_memo_summary.csv").is_file()
    with pytest.raises(ValueError, match="unknown anchor 'nope@0.1'.*qmatch"):
        accuracy.main(["--model", "embedded:demo", "--task", "memo", "--modes", "docstore_default",
                       "--anchors", "nope@0.1", "--limit", "1", "--out", str(tmp_path)])
