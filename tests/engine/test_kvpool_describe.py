"""``KVPool.describe()`` and ``TieredStore.describe()``: the snapshots the studio's cache view
draws (every block's state, the shared entries with readers and pins; each tier's bytes and
budget)."""

from __future__ import annotations

import torch

from promptcache.models.splice import KVSpec
from promptcache.engine.serving_core.kvpool import KVPool
from promptcache.store import StoreConfig, build_store

SPEC = KVSpec(layers=2, kv_heads=2, head_dim=4, dtype=torch.float32)


def test_pool_describe_says_each_blocks_state():
    pinned = {"b"}
    pool = KVPool(SPEC, "cpu", tokens=8 * 4, block_size=4, pinned=lambda k: k in pinned)  # 8 blocks
    own = pool.allocate(2)  # a running request's
    a = pool.allocate(2)
    pool.publish("a", a, 7, torch.arange(7))
    reader = pool.acquire("a")
    b = pool.allocate(1)
    pool.publish("b", b, 3, torch.arange(3))  # idle, pinned
    c = pool.allocate(1)
    pool.publish("c", c, 4, torch.arange(4))  # idle
    d = pool.describe()
    assert d["block_size"] == 4 and len(d["state"]) == 8
    assert [d["state"][i] for i in own] == ["request"] * 2
    assert [d["state"][i] for i in a + b + c] == ["entry"] * 4
    assert d["state"].count("free") == 2
    rows = {e["key"]: e for e in d["entries"]}
    assert rows["a"] == {"key": "a", "blocks": a, "tokens": 7, "refs": 1, "idle": False, "pinned": False}
    assert rows["b"]["idle"] and rows["b"]["pinned"] and rows["c"]["idle"] and not rows["c"]["pinned"]
    pool.release(reader)
    assert {e["key"]: e["refs"] for e in pool.describe()["entries"]}["a"] == 0


def test_store_describe_lists_tiers_with_budgets():
    store = build_store("cpu", StoreConfig(host_budget=1 << 20))
    store.put("k", torch.zeros(2, 2, 2, 3, 4))
    tiers = {t["name"]: t for t in store.describe()}
    assert tiers["host"]["budget"] == 1 << 20 and tiers["host"]["bytes"] == 2 * 2 * 2 * 3 * 4 * 4
    assert tiers["host"]["shared"] is False and "disk" in tiers
