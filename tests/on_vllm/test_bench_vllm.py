"""eval/bench_vllm.py end to end at a tiny size (its own vLLM server; the figures are eval's)."""

from __future__ import annotations

import csv

import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


def test_bench_vllm_runs(tmp_path, capsys):
    from eval import bench_vllm

    rows = bench_vllm.main(["--modules", "3", "--module-tokens", "48", "--imports", "2", "--requests", "2",
                            "--burst", "4", "--concurrency", "2", "--max-tokens", "2", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert "faster with the connector" in out and "throughput at 2 concurrent" in out
    connector, plain = rows
    assert connector["cached_tokens_mean"] >= plain["cached_tokens_mean"] and connector["cached_tokens_mean"] > 0
    with (tmp_path / "bench_vllm.csv").open() as f:
        assert [r["mode"] for r in csv.DictReader(f)] == ["connector", "plain"]
    assert (tmp_path / "bench_vllm.png").exists()
