"""eval/bench_vllm.py end to end at a tiny size (its own vLLM server; the figures are eval's)."""

from __future__ import annotations

import csv

import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


def test_bench_vllm_runs(tmp_path, capsys):
    from eval import bench_vllm

    rows = bench_vllm.main(["--modules", "3", "--module-tokens", "48", "--imports", "2", "--docs", "3",
                            "--doc-tokens", "48", "--retrieve", "2", "--requests", "2", "--burst", "4",
                            "--concurrency", "2", "--max-tokens", "2", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert "modules: TTFT p50" in out and "documents: TTFT p50" in out and "throughput at 2 concurrent" in out
    for workload in ("modules", "documents"):
        connector, plain = (r for r in rows if r["workload"] == workload)
        assert connector["mode"] == "connector" and plain["mode"] == "plain"
        assert connector["cached_tokens_mean"] >= plain["cached_tokens_mean"] and connector["cached_tokens_mean"] > 0
    with (tmp_path / "bench_vllm.csv").open() as f:
        assert [(r["workload"], r["mode"]) for r in csv.DictReader(f)] == [
            ("modules", "connector"), ("modules", "plain"), ("documents", "connector"), ("documents", "plain")]
    assert (tmp_path / "bench_vllm.png").exists()
