"""eval/kept_share.py: the paired statistics behind an accuracy study's "kept share"."""

from __future__ import annotations

import csv
import math

import pytest

from eval import kept_share

FIELDS = ["sample", "mode", "shuffled", "recompute", "full_correct", "pc_correct"]


def write(path, rows):
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, FIELDS)
        w.writeheader()
        for r in rows:
            w.writerow(dict(zip(FIELDS, r)))
    return path


def test_mcnemar_is_the_exact_binomial_tail():
    assert kept_share.mcnemar_p(0, 0) == 1.0
    assert kept_share.mcnemar_p(5, 5) == 1.0
    # 10 lost, 0 won: 2 * 0.5^10
    assert math.isclose(kept_share.mcnemar_p(10, 0), 2 / 1024)
    # 11 lost, 2 won: 2 * (C(13,0) + C(13,1) + C(13,2)) / 2^13
    assert math.isclose(kept_share.mcnemar_p(11, 2), 2 * (1 + 13 + 78) / 8192)
    assert kept_share.mcnemar_p(2, 11) == kept_share.mcnemar_p(11, 2)


def test_summary_counts_the_pairs_and_brackets_the_share():
    pairs = [(1, 1)] * 10 + [(1, 0)] * 4 + [(0, 1)] * 2 + [(0, 0)] * 4
    s = kept_share.summarize(pairs, 0.98)
    assert (s["full_correct"], s["method_correct"], s["lost_b"], s["won_c"]) == (14, 12, 4, 2)
    assert s["kept"] == round(12 / 14, 3)
    assert s["ci_low"] < s["kept"] < s["ci_high"]
    # a method equal to full prefill on every sample: no discordance, no doubt
    same = kept_share.summarize([(1, 1)] * 5 + [(0, 0)] * 5, 0.98)
    assert (same["kept"], same["ci_low"], same["ci_high"], same["lossless_below_bar"]) == (1.0, 1.0, 1.0, 0.0)


def test_later_files_win_and_other_methods_are_ignored(tmp_path):
    a = write(tmp_path / "a.csv", [("s0", "m", 0, "auto", 1, 0), ("s1", "m", 0, "auto", 1, 1),
                                   ("s0", "m", 0, "epic@0.15", 0, 0)])
    b = write(tmp_path / "b.csv", [("s0", "m", 0, "auto", 1, 1)])  # a rerun of s0
    assert kept_share.load([a, b], "auto") == {("s0", 0): (1, 1), ("s1", 0): (1, 1)}


def test_cli_writes_csv_and_names_a_bad_file(tmp_path, capsys):
    good = write(tmp_path / "g.csv", [(f"s{i}", "m", i % 2, "auto", 1, int(i % 3 > 0)) for i in range(12)])
    kept_share.main([str(good), "--out", str(tmp_path), "--tag", "_t"])
    with open(tmp_path / "kept_share_t.csv") as f:
        rows = list(csv.DictReader(f))
    assert [r["order"] for r in rows] == ["in order", "shuffled", "both"]
    assert int(rows[2]["samples"]) == 12
    bad = tmp_path / "bad.csv"
    bad.write_text("sample,mode\ns0,m\n")
    with pytest.raises(SystemExit, match=r"bad\.csv:2"):
        kept_share.main([str(bad)])
    with pytest.raises(SystemExit, match="no rows with recompute='nope'"):
        kept_share.main([str(good), "--method", "nope"])


def test_full_vs_pairs_two_runs_full_prefill(tmp_path, capsys):
    a = write(tmp_path / "fp32.csv", [("s0", "m", 0, "auto", 1, 0), ("s1", "m", 0, "auto", 0, 0),
                                      ("s2", "m", 1, "auto", 1, 1)])
    b = write(tmp_path / "bf16.csv", [("s0", "m", 0, "auto", 0, 1), ("s1", "m", 0, "auto", 1, 1),
                                      ("s3", "m", 0, "auto", 1, 1)])
    assert kept_share.full_against([a], b) == {("s0", 0): (1, 0), ("s1", 0): (0, 1)}
    kept_share.main([str(a), "--full-vs", str(b), "--out", str(tmp_path)])
    with open(tmp_path / "kept_share.csv") as f:
        rows = [r for r in csv.DictReader(f) if r["method"] == "full:bf16" and r["order"] == "in order"]
    assert (rows[0]["lost_b"], rows[0]["won_c"]) == ("1", "1")
    c = write(tmp_path / "other.csv", [("x9", "m", 0, "auto", 1, 1)])
    with pytest.raises(SystemExit, match="shares no"):
        kept_share.main([str(a), "--full-vs", str(c)])
