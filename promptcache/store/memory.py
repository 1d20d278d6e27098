"""A memory tier (GPU or host) with a byte budget and least-recently-used order.

Not thread-safe by itself: ``TieredStore`` calls it under its index lock (``io = False``)."""

from __future__ import annotations

from collections import OrderedDict
from typing import Callable

import torch

from .base import Tier, check_policy, nbytes


class MemoryTier(Tier):
    def __init__(self, name: str, device: torch.device | str, budget: int | None = None, pin: bool = False,
                 write_policy: str = "on_evict"):
        self.name, self.device, self.budget = name, torch.device(device), budget
        self.write_policy = check_policy(write_policy)
        self.pin = pin and self.device.type == "cpu" and torch.cuda.is_available()
        self._data: OrderedDict[str, torch.Tensor] = OrderedDict()
        self._bytes = 0

    def get(self, key: str) -> torch.Tensor | None:
        t = self._data.get(key)
        if t is not None:
            self._data.move_to_end(key)
        return t

    def put(self, key: str, kv: torch.Tensor) -> None:
        if key in self._data:
            self._data.move_to_end(key)
            return
        if kv.device != self.device:
            kv = kv.to(self.device)
        if self.pin and not kv.is_pinned():
            kv = kv.pin_memory()  # pinned host memory: host -> GPU copies need not block the CPU
        self._data[key] = kv
        self._bytes += nbytes(kv)

    def evict(self, key: str) -> torch.Tensor | None:
        t = self._data.pop(key, None)
        if t is not None:
            self._bytes -= nbytes(t)
        return t

    def keys(self) -> list[str]:
        """The keys held, least recently used first."""
        return list(self._data)

    def lru(self) -> str | None:
        return next(iter(self._data), None)

    def lru_except(self, keep: Callable[[str], bool]) -> str | None:
        return next((k for k in self._data if not keep(k)), None)

    @property
    def bytes_used(self) -> int:
        return self._bytes

    def __contains__(self, key: str) -> bool:
        return key in self._data

    def __len__(self) -> int:
        return len(self._data)
