"""eval/profiler_floor.py on a tiny RAG batch: the static forward run eagerly, compiled and by
AOTInductor gives the same logits, and what each leaves to the host is reported beside the profile's figure."""

from __future__ import annotations

import csv
import importlib

import pytest


@pytest.mark.slow
def test_profiler_floor_runs_the_static_forward_three_ways_with_the_same_logits(tmp_path, capsys):
    importlib.import_module("eval.profiler_floor").main(
        ["--batches", "2", "--docs", "4", "--doc-len", "8", "--k", "2", "--system", "4", "--question", "3",
         "--generated", "2", "--repeats", "2", "--out", str(tmp_path)])
    with (tmp_path / "profiler_floor.csv").open() as f:
        rows = {r["forward"]: r for r in csv.DictReader(f)}
    assert set(rows) == {"eager", "compiled", "aot"}
    for r in rows.values():
        assert r["batch"] == "2" and float(r["max_diff"]) <= 1e-4  # (the study stops on a larger one)
        assert float(r["plain_ms"]) > 0 and float(r["kernel_ms"]) > 0 and float(r["host_ms"]) > 0
        assert float(r["profiler_ms"]) == pytest.approx(float(r["profiled_ms"]) - float(r["plain_ms"]), abs=2e-3)
        assert float(r["net_ms"]) == pytest.approx(float(r["plain_ms"]) - float(r["kernel_ms"]), abs=2e-3)
    # the AOTInductor forward's kernels are in the profile (inductor's, and aten's called from its C++):
    # fewer events than the eager forward's modules make
    assert 0 < int(rows["aot"]["events"]) < int(rows["eager"]["events"])
    assert float(rows["aot"]["build_s"]) > 0
    assert (tmp_path / "profiler_floor.png").exists()
    assert "unprofiled - kernels" in capsys.readouterr().out
