"""Pins: eviction from a memory tier skips live pinned keys, until their deadline; the pin
budget refuses a pin whole."""

from __future__ import annotations

import pytest
import torch

from promptcache.store import DiskTier, MemoryTier, PinBudgetError, Pins, TieredStore
from promptcache.store.base import nbytes


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def kv(seed: int) -> torch.Tensor:
    return torch.randn(2, 2, 2, 3, 4, generator=torch.Generator().manual_seed(seed))  # [L, 2, H, n, D]


def test_pinned_key_stays_in_memory_until_its_deadline(tmp_path):
    size = nbytes(kv(0))
    store = TieredStore([MemoryTier("host", "cpu", budget=2 * size), DiskTier(tmp_path)])
    clock = Clock()
    store.pins = Pins(budget=size, clock=clock)
    store.put("a", kv(0))
    store.pins.pin({"a": (size, 300)})
    for i in range(1, 6):  # pressure: "a" is the least recently used every time
        store.put(f"k{i}", kv(i))
    assert store.tier_of("a") == "host" and store.tier_of("k1") == "disk"
    clock.now = 301
    store.put("k6", kv(6))
    assert store.tier_of("a") == "disk"  # the pin ran out: evicted as usual
    assert torch.equal(store.get("a")[0], kv(0))  # and still served from the lower tier


def test_pin_budget_refuses_whole_and_counts_a_key_once():
    clock = Clock()
    pins = Pins(budget=100, clock=clock)
    pins.pin({"a": (60, 10)})
    pins.pin({"a": (60, 20)})  # again: counted once, deadline extended
    assert pins.bytes_pinned == 60
    with pytest.raises(PinBudgetError, match="pin budget"):
        pins.pin({"b": (30, 10), "c": (30, 10)})
    assert not pins.live("b") and len(pins) == 1
    clock.now = 15
    assert pins.live("a")
    clock.now = 20
    assert not pins.live("a") and pins.bytes_pinned == 0
    pins.pin({"b": (30, 10), "c": (30, 10)})
    assert pins.live("b") and pins.live("c")
