"""eval/bench_remote.py end to end on the small embedded model (three fresh processes; marked slow)."""

from __future__ import annotations

import csv

import pytest


@pytest.mark.slow
def test_bench_remote_runs(redis_server, tmp_path, capsys):
    from eval import bench_remote as bench

    bench.main(["--model", "embedded", "--device", "cpu", "--schema-tokens", "200", "--repeats", "1",
                "--remote", redis_server.url, "--out", str(tmp_path)])
    rows = {r["mode"]: r for r in csv.DictReader((tmp_path / "remote.csv").open())}
    assert set(rows) == {"encode", "remote", "disk"}
    assert int(rows["encode"]["bytes_moved"]) == 0 < int(rows["disk"]["bytes_moved"])
    assert int(rows["remote"]["bytes_moved"]) >= int(rows["disk"]["bytes_moved"])  # safetensors framing on top
    assert "faster than encoding" in capsys.readouterr().out
