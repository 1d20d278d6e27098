"""The soak's 60-second version (``eval/soak.py``) on the embedded model: a mixed load with bad
requests, abandoned streams, client time-outs and a 2M-character /tokenize beside a /health
poller, then a SIGKILL and a restart on the spill folder."""

from __future__ import annotations

import pytest


@pytest.mark.slow  # one minute of load, and two server starts (~25 s each on a busy 2-core machine)
def test_a_minute_of_mixed_load_then_a_sigkill(tmp_path):
    from eval import soak

    r = soak.main(["--model", "embedded", "--minutes", "1", "--clients", "4", "--big-every", "20",
                   "--disk-lag", "0.5", "--out", str(tmp_path)])
    assert r["unexpected"] == 0, r["unexpected_first"]
    assert r["requests"].get("bad 4xx", 0) > 0 and r["requests"].get("chat 200", 0) > 0
    assert r["requests"].get("abandon abandoned", 0) > 0 and r["requests"].get("messages 200", 0) > 0
    assert r["big_tokenizes"] >= 1
    # /health never waits for the big tokenize (a loaded machine: a generous bound, far below it)
    assert r["health_max_during_big_ms"] < 1000 * r["big_tokenize_s"] / 2
    assert r["pool_back_to_baseline"], r["pool_at_end"]
    assert r["cached_warm"] > 0 and r["cached_share_after_sigkill"] >= 0.9
    assert r["rss_beyond_caches_growth_mb"] is not None and r["rss_beyond_caches_growth_mb"] <= 200
