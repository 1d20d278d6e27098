"""``Pins``: keys a memory tier must not evict until a deadline, within a byte budget.

This is how an Anthropic-style ``cache_control`` breakpoint keeps "the prefix up to here" warm
for its TTL: the server pins the prefix's block keys, and ``TieredStore`` skips pinned keys when
it evicts from a memory tier (``Tier.lru_except``). A pin is a deadline, not a reference count:
pinning a key again extends it to the later deadline. Expired pins are dropped lazily.

Decisions: the budget counts the bytes of distinct live pinned keys (a key pinned twice counts
once); a pin that would pass it is refused whole (``PinBudgetError``), nothing is pinned half.
Pinning a key the store does not hold yet is fine (the request that stores it pins it first, so
it is never evicted between being stored and being pinned). Thread-safe: the server pins from its
prep thread, the store reads ``live`` from the engine thread.
"""

from __future__ import annotations

import threading
import time
from typing import Callable

from ..errors import PromptCacheError

__all__ = ["PinBudgetError", "Pins"]


class PinBudgetError(PromptCacheError, ValueError):
    """Pinning these keys would pass the pin budget."""

    exit_code = 2


class Pins:
    """key -> (deadline, bytes). ``clock``: seconds, monotonic (tests pass a fake one)."""

    def __init__(self, budget: int, clock: Callable[[], float] = time.monotonic):
        if budget < 0:
            raise ValueError(f"the pin budget must be >= 0 bytes, got {budget}")
        self.budget, self.clock = budget, clock
        self._pins: dict[str, tuple[float, int]] = {}
        self._lock = threading.Lock()

    def pin(self, keys: dict[str, tuple[int, float]]) -> None:
        """Pin each key (key -> (state bytes, ttl seconds from now)); all or none."""
        bad = [ttl for _, ttl in keys.values() if not ttl > 0]
        if bad:
            raise ValueError(f"a pin's ttl must be > 0 seconds, got {bad[0]}")
        with self._lock:
            self._expire()
            new = sum(n for k, (n, _) in keys.items() if k not in self._pins)
            used = self._used()
            if used + new > self.budget:
                raise PinBudgetError(f"pinning {new / 2**20:.2f} MiB more would pass the pin budget of "
                                     f"{self.budget / 2**20:.2f} MiB ({used / 2**20:.2f} MiB pinned now)")
            now = self.clock()
            for k, (n, ttl) in keys.items():
                old = self._pins.get(k)
                self._pins[k] = (max(now + ttl, old[0]) if old else now + ttl, n)

    def live(self, key: str) -> bool:
        """Whether ``key`` is pinned now (its deadline has not passed)."""
        with self._lock:
            entry = self._pins.get(key)
            return entry is not None and entry[0] > self.clock()

    @property
    def bytes_pinned(self) -> int:
        with self._lock:
            self._expire()
            return self._used()

    def __len__(self) -> int:
        with self._lock:
            self._expire()
            return len(self._pins)

    def _used(self) -> int:
        return sum(n for _, n in self._pins.values())

    def _expire(self) -> None:
        now = self.clock()
        for k in [k for k, (until, _) in self._pins.items() if until <= now]:
            del self._pins[k]
