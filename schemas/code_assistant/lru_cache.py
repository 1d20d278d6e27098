# file: lru_cache.py
"""A small thread-safe LRU cache with per-entry time-to-live."""

import threading
import time
from collections import OrderedDict


class LRUCache:
    def __init__(self, capacity: int, ttl: float | None = None):
        if capacity < 1:
            raise ValueError(f"capacity must be positive, got {capacity}")
        self.capacity = capacity
        self.ttl = ttl
        self._data: OrderedDict[str, tuple[float, object]] = OrderedDict()
        self._lock = threading.Lock()
        self.hits = self.misses = 0

    def get(self, key: str, default=None):
        with self._lock:
            item = self._data.get(key)
            if item is None or self._expired(item[0]):
                self.misses += 1
                self._data.pop(key, None)
                return default
            self._data.move_to_end(key)
            self.hits += 1
            return item[1]

    def put(self, key: str, value) -> None:
        with self._lock:
            self._data[key] = (time.monotonic(), value)
            self._data.move_to_end(key)
            while len(self._data) > self.capacity:
                self._data.popitem(last=False)

    def _expired(self, stored_at: float) -> bool:
        return self.ttl is not None and time.monotonic() - stored_at > self.ttl

    def __len__(self) -> int:
        return len(self._data)
