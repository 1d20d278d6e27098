"""/metrics tells pool blocks by state, queued from running requests, and hits per tier."""

from __future__ import annotations

import time

from serverkit import MODEL, client, http, metric

SYSTEM = "You are a careful assistant for a museum in Lisbon; answer in one short line. " * 4


def _states(url: str) -> dict[str, float]:
    return {s: metric(url, "promptcache_kv_pool_blocks_by_state", state=s)
            for s in ("free", "request", "shared", "pinned", "idle")}


def test_pool_blocks_by_state_add_up_and_cached_blocks_are_idle_or_pinned(server):
    url = server[0]
    oai = client(url)
    hits = metric(url, "promptcache_tier_hits_total", tier="pool")
    for q in ("Opening hours?", "Ticket prices?"):
        oai.chat.completions.create(model=MODEL, max_tokens=2, temperature=0,
                                    messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}])
    states = _states(url)
    assert sum(states.values()) == metric(url, "promptcache_kv_pool_blocks")
    assert states["free"] == metric(url, "promptcache_kv_pool_free")
    assert states["idle"] + states["pinned"] > 0 and states["request"] == 0  # answers done: cached, not in use
    assert metric(url, "promptcache_tier_hits_total", tier="pool") > hits  # the second chat read the first's blocks
    status, _, _ = http("POST", url + "/v1/messages", {
        "model": MODEL, "max_tokens": 2, "system": [{"type": "text", "text": SYSTEM + " Pinned.",
                                                     "cache_control": {"type": "ephemeral"}}],
        "messages": [{"role": "user", "content": "Hello"}]})
    assert status == 200
    assert _states(url)["pinned"] > 0  # the breakpoint's blocks: idle but kept


def test_queued_and_running_requests_are_told_apart(server):
    url = server[0]
    oai = client(url)
    stream = oai.chat.completions.create(model=MODEL, max_tokens=4000, temperature=0, stream=True,
                                         extra_body={"ignore_eos": True},
                                         messages=[{"role": "user", "content": "Count to a thousand."}])
    try:
        next(iter(stream))  # prefilled; its reader now lags, so the request is paused, still running
        deadline = time.monotonic() + 30
        while metric(url, "promptcache_requests_running") < 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        running, queued = metric(url, "promptcache_requests_running"), metric(url, "promptcache_requests_queued")
        assert running >= 1 and queued >= 0
        assert running + queued == metric(url, "promptcache_requests_in_flight")
        assert _states(url)["request"] + _states(url)["shared"] > 0  # its blocks are in use
    finally:
        stream.close()
    deadline = time.monotonic() + 30
    while metric(url, "promptcache_requests_in_flight") > 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert metric(url, "promptcache_requests_running") == 0 and metric(url, "promptcache_requests_queued") == 0


def test_resident_bytes_count_the_pages_written_not_the_size():
    import sys

    import pytest
    import torch

    from promptcache.server.core.metrics import resident_bytes

    if not sys.platform.startswith("linux"):
        pytest.skip("mincore's page-by-page answer is Linux's")
    mb = 2**20
    t = torch.empty(64 * mb // 4)  # large enough to be its own untouched mapping
    assert resident_bytes(t) < mb
    t[: 16 * mb // 4] = 1.0
    assert 16 * mb <= resident_bytes(t) < 17 * mb
    t.fill_(2.0)
    assert 64 * mb <= resident_bytes(t) < 65 * mb
    assert resident_bytes(torch.empty(0)) == -1


def test_the_pool_resident_gauge_is_between_zero_and_the_pool(server):
    url = server[0]
    resident = metric(url, "promptcache_kv_pool_resident_bytes")
    assert 0 < resident <= metric(url, "promptcache_kv_pool_bytes") + 8192
