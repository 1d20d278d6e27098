"""Redis down, slow or full: a warning, a count in ``stats``, a miss or a dropped write; never an exception."""

from __future__ import annotations

import logging
import threading
import time

import torch

from promptcache.store.remote import PREFIX, RedisTier

KEY, OTHER = "ab" * 32, "cd" * 32


def state(n: int = 50) -> torch.Tensor:
    return torch.arange(2 * 2 * 4 * n * 16, dtype=torch.float32).reshape(2, 2, 4, n, 16)


def warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]


def test_killed_mid_run_then_restarted_works_again_without_a_new_tier(redis_server, caplog):
    tier = RedisTier(redis_server.url, retry_after=(0.1, 0.2))
    tier.put(KEY, state())
    assert torch.equal(tier.get(KEY), state())
    redis_server.stop()
    with caplog.at_level(logging.INFO, logger="promptcache.store.remote"):
        for _ in range(3):
            assert tier.get(KEY) is None  # a miss, not an exception
            tier.put(OTHER, state())  # dropped
            assert OTHER not in tier
            time.sleep(0.12)  # past the back-off: each round tries Redis again
        assert len(warnings(caplog)) == 1 and "unavailable" in warnings(caplog)[0]  # once per outage
        assert tier.stats["errors"] >= 2 and tier.stats["misses"] >= 3
        redis_server.start()  # same port, empty (no persistence)
        time.sleep(0.25)
        tier.put(OTHER, state())
        assert torch.equal(tier.get(OTHER), state())
    assert "reachable again" in caplog.text
    redis_server.stop()
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="promptcache.store.remote"):
        assert tier.get(OTHER) is None
    assert len(warnings(caplog)) == 1  # a second outage warns again


def test_back_off_skips_redis_until_the_retry_time(redis_server):
    tier = RedisTier(redis_server.url, retry_after=(60.0, 60.0))
    redis_server.stop()
    assert tier.get(KEY) is None
    errors = tier.stats["errors"]
    redis_server.start()
    assert tier.get(KEY) is None and KEY not in tier  # still in back-off: Redis not asked
    assert tier.stats["errors"] == errors


def test_slow_redis_times_out_as_a_miss(redis_server, caplog):
    tier = RedisTier(redis_server.url, timeout=0.2, retry_after=(0.1, 0.1))
    tier.put(KEY, state())
    pauser = threading.Thread(target=lambda: redis_server.client().execute_command("CLIENT", "PAUSE", 1500, "ALL"))
    pauser.start()
    pauser.join()
    with caplog.at_level(logging.WARNING, logger="promptcache.store.remote"):
        assert tier.get(KEY) is None  # the server does not answer within 0.2 s
    assert tier.stats["errors"] == 1 and "unavailable" in caplog.text
    redis_server.client().execute_command("CLIENT", "UNPAUSE")
    time.sleep(0.15)
    assert torch.equal(tier.get(KEY), state())


def test_full_redis_drops_the_write_with_a_warning(start_redis, caplog):
    server = start_redis(extra=("--maxmemory", "3mb", "--maxmemory-policy", "noeviction"))
    tier = RedisTier(server.url, chunk_bytes=256 << 10)
    big = state(n=8000)  # 16 MiB: cannot fit
    with caplog.at_level(logging.WARNING, logger="promptcache.store.remote"):
        tier.put(KEY, big)
        tier.put(OTHER, big)
    assert KEY not in tier and tier.get(KEY) is None
    assert tier.stats["errors"] == 2 and tier.stats["bytes_out"] == 0
    assert len(warnings(caplog)) == 1 and "full" in warnings(caplog)[0]
    assert server.client().keys(f"{PREFIX}:*") == []  # the chunks written before the OOM were dropped
    tier.put(KEY, state())  # a small state still fits: no back-off after a full Redis
    assert torch.equal(tier.get(KEY), state())


def test_lru_eviction_never_returns_a_partial_state(start_redis):
    server = start_redis(extra=("--maxmemory", "4mb", "--maxmemory-policy", "allkeys-lru"))
    tier = RedisTier(server.url, chunk_bytes=64 << 10)
    keys = [f"{i:064x}" for i in range(12)]
    for k in keys:  # 12 x 0.5 MiB into 4 MiB: Redis evicts chunks and headers as it likes
        tier.put(k, state(n=2000) + int(k, 16))
    got = {k: tier.get(k) for k in keys}
    assert any(v is None for v in got.values())
    assert all(torch.equal(v, state(n=2000) + int(k, 16)) for k, v in got.items() if v is not None)
    assert tier.stats["errors"] == 0
