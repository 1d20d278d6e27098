"""eval/bench_rag.py runs end to end on a tiny stream (smoke: hit rates, not timings)."""

from __future__ import annotations

from eval import bench_rag


def test_workload_is_zipf_and_distinct():
    reqs = bench_rag.workload(docs=20, queries=200, k=4, s=1.0)
    assert all(len(set(r)) == 4 for r in reqs)
    counts = sorted((sum(d in r for r in reqs) for d in {d for r in reqs for d in r}), reverse=True)
    assert counts[0] > 3 * counts[-1]  # popular documents recur far more often


def test_bench_rag_smoke(tmp_path):
    rows = bench_rag.main(["--model", "embedded:demo", "--docs", "6", "--queries", "5", "--doc-tokens", "16",
                           "--threads", "1", "--out", str(tmp_path)])
    by = {r["mode"]: r for r in rows}
    assert set(by) == set(bench_rag.MODES) and (tmp_path / "bench_rag.csv").is_file()
    assert by["no_cache"]["token_hit_rate"] == 0.0
    assert 0.0 < by["exact"]["token_hit_rate"] < by["independent"]["token_hit_rate"] < 1.0  # "auto" recomputes some
    assert by["default"]["token_hit_rate"] == by["independent"]["token_hit_rate"]  # no chain store beside it


def test_chain_hit_rates_by_hand():
    reqs = [["a", "b"], ["a", "c"], ["b", "a"], ["a", "b"]]
    tokens = {"a": 10, "b": 10, "c": 10}
    # fixed prefix 5, question 5: totals 30; hits: prefix only, prefix + a, prefix only, prefix + a + b
    assert bench_rag.chain_hit_rates(reqs, False, tokens, 5, 5) == [5 / 30, 15 / 30, 5 / 30, 25 / 30]
    # canonical order: ["b", "a"] is ["a", "b"], stored by the first request
    assert bench_rag.chain_hit_rates(reqs, True, tokens, 5, 5) == [5 / 30, 15 / 30, 25 / 30, 25 / 30]


def test_baseline_every_times_a_subset(tmp_path):
    rows = bench_rag.main(["--model", "embedded:demo", "--docs", "6", "--queries", "6", "--doc-tokens", "16",
                           "--threads", "1", "--modes", "no_cache", "--baseline-every", "3", "--out", str(tmp_path)])
    assert rows[0]["timed"] == 2 and rows[0]["queries"] == 6
