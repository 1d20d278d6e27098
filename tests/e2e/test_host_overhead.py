"""eval/host_overhead.py on a tiny RAG batch: aten calls per layer and host time per step, eager and compiled."""

from __future__ import annotations

import csv
import importlib


def test_host_overhead_counts_calls_a_layer_that_do_not_grow_with_the_rows_without_the_native_kernel(tmp_path,
                                                                                                      capsys):
    importlib.import_module("eval.host_overhead").main(
        ["--native", "off", "--compile", "off,on", "--batches", "1,3", "--docs", "4", "--doc-len", "8", "--k", "2",
         "--system", "4", "--question", "3", "--generated", "2", "--repeats", "1", "--out", str(tmp_path)])
    rows = list(csv.DictReader((tmp_path / "host_overhead.csv").open()))
    assert {(r["compile"], r["step"], r["batch"]) for r in rows} == \
        {(c, s, b) for c in ("off", "on") for s in ("prefill", "decode") for b in ("1", "3")}
    cell = {(r["compile"], r["step"], int(r["batch"])): r for r in rows}
    for r in rows:
        assert r["native"] == "off" and int(r["aten_forward"]) > 0
        assert float(r["host_ms"]) > 0 and float(r["kernel_ms"]) > 0 and float(r["wall_ms"]) > 0
        assert r["compiled"] == str(r["compile"] == "on")  # every step here fits the compile buckets
        assert float(r["calls_layer"]) < float(r["aten_layer"])  # direct calls: nested events left out
    for c in ("off", "on"):
        for step in ("prefill", "decode"):
            # one padded call a layer, and the step's metadata built in a constant number of ops:
            # neither the attention's calls nor the whole step's grow with the rows
            assert cell[c, step, 3]["attn_calls_layer"] == cell[c, step, 1]["attn_calls_layer"]
        assert cell[c, "decode", 3]["calls_layer"] == cell[c, "decode", 1]["calls_layer"]
    assert float(cell["off", "decode", 3]["attn_layer"]) <= 60 and float(cell["off", "decode", 3]["attn_calls_layer"]) <= 14
    # compiled: the model's norms, rotary and activations are inductor's kernels, not aten calls
    assert float(cell["on", "decode", 3]["calls_layer"]) < float(cell["off", "decode", 3]["calls_layer"]) / 1.5
    assert (tmp_path / "host_overhead.png").exists()
    out = capsys.readouterr().out
    assert "attention aten/layer" in out and "compiled" in out


def test_host_overhead_static_steps_compiled_whole_have_no_attention_op_and_say_what_the_host_does_around_them(
        tmp_path, capsys):
    """``--compile static``: decode steps over a bucket's buffers compiled whole (prefill steps run
    eagerly): no attention function or op left in the step, fewer direct calls than the compiled
    steps' opaque attention op makes, and ``around_ms`` (host time outside the static forward) is
    part of the host time."""
    importlib.import_module("eval.host_overhead").main(
        ["--native", "off", "--compile", "static", "--batches", "2,8", "--docs", "4", "--doc-len", "8", "--k", "2",
         "--system", "4", "--question", "3", "--generated", "2", "--repeats", "1", "--out", str(tmp_path)])
    cell = {(r["step"], int(r["batch"])): r for r in csv.DictReader((tmp_path / "host_overhead.csv").open())}
    for b in (2, 8):
        decode, prefill = cell["decode", b], cell["prefill", b]
        assert decode["compiled"] == "True" and prefill["compiled"] == "False"
        assert float(decode["attn_layer"]) == 0  # the attention is the graph's kernels, no function of its own
        assert float(prefill["attn_layer"]) > 0
        assert 0 < float(decode["around_ms"]) < float(decode["host_ms"])
        assert prefill["around_ms"] == ""  # no static forward in a prefill step
        assert float(decode["calls_layer"]) < float(prefill["calls_layer"]) / 2
    assert cell["decode", 8]["calls_layer"] == cell["decode", 2]["calls_layer"]  # one graph (symbolic rows)
    assert "around the static forward" in capsys.readouterr().out
