"""The engine and storage benchmark scripts run end to end on the small embedded model."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

EVAL = Path(__file__).resolve().parents[2] / "eval"


def load(name):
    sys.path.insert(0, str(EVAL))
    spec = importlib.util.spec_from_file_location(f"eval_{name}", EVAL / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_bench_store_runs(capsys):
    load("bench_store").main(["--model", "embedded", "--schema-tokens", "200", "--prompts", "2", "--repeats", "1"])
    out = capsys.readouterr().out
    assert "faster than encoding" in out and "bytes copied over 4 prompts" in out


def test_bench_engine_runs(capsys):
    load("bench_engine").main(["--model", "embedded", "--schema-tokens", "200", "--new-tokens", "8",
                               "--repeats", "1"])
    out = capsys.readouterr().out
    assert "the limit" in out and "stored bytes per token" in out
