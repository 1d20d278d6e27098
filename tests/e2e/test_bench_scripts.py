"""The engine and storage benchmark scripts run end to end on the small embedded model."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest


def load(name):
    return importlib.import_module(f"eval.{name}")


def test_bench_store_runs(capsys):
    load("bench_store").main(["--model", "embedded", "--schema-tokens", "200", "--prompts", "2", "--repeats", "1"])
    out = capsys.readouterr().out
    assert "faster than encoding" in out and "bytes copied over 4 prompts" in out


def test_bench_engine_runs(capsys):
    load("bench_engine").main(["--model", "embedded", "--schema-tokens", "200", "--new-tokens", "8",
                               "--repeats", "1"])
    out = capsys.readouterr().out
    assert "the limit" in out and "stored bytes per token" in out


def test_bench_engine_reports_first_prompt_encode_ratio_and_stored_dtype(capsys):
    load("bench_engine").main(["--model", "embedded", "--schema-tokens", "120", "--new-tokens", "4",
                               "--repeats", "1"])
    out = capsys.readouterr().out
    assert "first prompt of a fresh engine" in out and "one plain prefill of its tokens" in out
    assert "stored bytes per token (float32)" in out and "+0.00%)" in out
    assert "preallocated cache, last-token logits" in out


def test_bench_encode_compares_encoding_with_a_plain_prefill(tmp_path, capsys):
    rows = load("bench_encode").main(["--model", "embedded", "--tokens", "120", "--members", "3", "--repeats", "1",
                                      "--kv-dtype", "bfloat16", "--out", str(tmp_path)])
    (r,) = rows
    assert r["tokens_run"] >= r["stored_tokens"] > 0  # union members re-run (and store) the documents after the union
    assert r["encode_s"] > 0 and r["plain_prefill_s"] > 0 and r["kv_dtype"] == "bfloat16"
    assert (tmp_path / "encode.csv").exists() and "one plain prefill" in capsys.readouterr().out


def test_memory_resident_study_reports_theory(tmp_path):
    per_token, rows = load("memory").main(["--model", "embedded", "--skip-peaks", "--resident", "96",
                                           "--out", str(tmp_path)])
    assert [r["kv_dtype"] for r in rows] == ["model", "bfloat16"]
    model_row, half = rows
    assert half["states"] * 2 == model_row["states"]  # bfloat16 stores half the bytes
    assert all(r["theory"] == r["model_bytes"] + r["states"] and r["after_encode"] > 0 for r in rows)


@pytest.mark.slow  # three replicas and a router as subprocesses
def test_bench_cluster_runs_replicas_behind_a_router(tmp_path, capsys):
    import shutil

    exe = shutil.which("sglang-router") or shutil.which("sglang-router", path=str(Path(sys.executable).parent))
    assert exe, "sglang-router must be on the PATH or beside the interpreter (the dev extras install it)"
    load("bench_cluster").main(["--routers", str(Path(exe).parent), "--configs", "cache_aware", "--prompts", "2",
                                "--conversations", "2", "--turns", "2", "--reply", "2", "--out", str(tmp_path)])
    rows = (tmp_path / "cluster.csv").read_text().splitlines()
    assert rows[0].startswith("config,requests,errors,hit_rate")
    cache_aware = [r.split(",") for r in rows[1:] if r.startswith("cache_aware:sglang-router")]
    assert cache_aware and cache_aware[0][1:3] == ["4", "0"]  # 4 requests, no error
    assert float(cache_aware[0][3]) > 0  # the second turns hit their first turns' blocks
