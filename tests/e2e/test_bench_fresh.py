"""The engine benchmark's round-robin timing and its fresh-process first prompt."""

from __future__ import annotations

import importlib

from promptcache import bench


def _bench_engine():
    return importlib.import_module("eval.bench_engine")


def test_round_robin_times_one_call_of_each_method_per_round():
    calls = []
    methods = {name: (lambda name=name: calls.append(name)) for name in ("a", "b", "c")}
    times = bench.round_robin(methods, 3, only={"b": 1})
    assert calls == ["a", "b", "c", "a", "c", "a", "c"]  # b only in the first round, order kept per round
    assert set(times) == {"a", "b", "c"} and all(t >= 0 for t in times.values())


def test_fresh_process_first_prompt_copies_nothing(tmp_path, capsys):
    rows = _bench_engine().main(["--model", "embedded", "--schema-tokens", "120", "--new-tokens", "4",
                                 "--skip-bench", "--fresh-processes", "1", "--threads", "1", "--out", str(tmp_path)])
    (r,) = rows
    assert r["cached_tokens"] > 0 and r["first_s"] > 0 and r["limit_s"] > 0
    assert r["first_bytes_copied"] == 0  # registration placed the default pass: the first prompt finds it in place
    assert (tmp_path / "engine_fresh.csv").is_file()
    assert "fresh process 0" in capsys.readouterr().out
