"""eval/host_overhead.py on a tiny RAG batch: aten calls per layer and host time per step."""

from __future__ import annotations

import csv
import importlib


def test_host_overhead_counts_one_attention_call_a_layer_at_any_batch_without_the_native_kernel(tmp_path, capsys):
    importlib.import_module("eval.host_overhead").main(
        ["--native", "off", "--batches", "1,3", "--docs", "4", "--doc-len", "8", "--k", "2", "--system", "4",
         "--question", "3", "--generated", "2", "--repeats", "1", "--out", str(tmp_path)])
    rows = list(csv.DictReader((tmp_path / "host_overhead.csv").open()))
    assert {(r["step"], r["batch"]) for r in rows} == {(s, b) for s in ("prefill", "decode") for b in ("1", "3")}
    cell = {(r["step"], int(r["batch"])): r for r in rows}
    for r in rows:
        assert r["native"] == "off" and int(r["aten_forward"]) > 0
        assert float(r["host_ms"]) > 0 and float(r["kernel_ms"]) > 0 and float(r["wall_ms"]) > 0
    # one padded call a layer: the calls the attention makes do not grow with the rows
    for step in ("prefill", "decode"):
        assert cell[step, 3]["attn_calls_layer"] == cell[step, 1]["attn_calls_layer"]
    assert float(cell["decode", 3]["attn_layer"]) <= 60 and float(cell["decode", 3]["attn_calls_layer"]) <= 20
    assert (tmp_path / "host_overhead.png").exists()
    assert "attention aten/layer" in capsys.readouterr().out
