"""``eval/bench_streams.py`` end to end on the small embedded model: streams decode while
default-mode RAG questions are admitted, and the row says what their gaps were."""

from __future__ import annotations

import csv
import importlib


def test_bench_streams_measures_the_streams_gaps_while_questions_are_admitted(tmp_path, capsys):
    bench = importlib.import_module("eval.bench_streams")
    bench.main(["--model", "embedded", "--streams", "3", "--questions", "2", "--docs", "4", "--k", "2",
                "--doc-tokens", "40", "--stream-tokens", "60", "--settle", "2", "--answer-tokens", "2",
                "--budget", "32", "--out", str(tmp_path), "--tag", "_tiny"])
    (row,) = list(csv.DictReader((tmp_path / "bench_streams_tiny.csv").open()))
    assert (int(row["streams"]), int(row["questions"]), int(row["k"])) == (3, 2, 2)
    assert int(row["question_tokens"]) > 2 * 30  # two documents of ~40 tokens, the question and the prefix
    assert int(row["recomputed"]) > 0  # default mode: drifted document tokens run as rows of the step
    assert int(row["gaps"]) > 0  # the streams kept decoding while the questions were admitted
    p50, p99, top = float(row["p50_ms"]), float(row["p99_ms"]), float(row["max_ms"])
    assert 0 < p50 <= p99 <= top
    assert float(row["p99_over_p50"]) == round(p99 / p50, 2) or abs(float(row["p99_over_p50"]) - p99 / p50) < 0.02
    assert "p99_over_p50=" in capsys.readouterr().out
