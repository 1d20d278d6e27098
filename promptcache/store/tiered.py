"""Tiers stacked fastest first (device, host, disk): LRU eviction down, promotion up on use."""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from pathlib import Path

import torch

from .base import StoreError, Tier, nbytes
from .disk import DiskTier
from .memory import MemoryTier

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class StoreConfig:
    """Byte budgets per tier (None: unbounded). On a CPU-only engine the device *is* host memory:
    there is one memory tier, named "host", with ``host_budget``."""

    device_budget: int | None = None
    host_budget: int | None = None
    spill_dir: str | None = None  # where evicted states go when no artifact holds them (default: a temp dir)
    pin_memory: bool = True  # pin host states when a GPU is used

    def __post_init__(self):
        for name in ("device_budget", "host_budget"):
            v = getattr(self, name)
            if v is not None and v < 0:
                raise ValueError(f"{name} must be >= 0 bytes, got {v}")


class TieredStore:
    """get / put over the tiers; thread-safe."""

    def __init__(self, device: torch.device, config: StoreConfig | None = None):
        config = config or StoreConfig()
        self.tiers: list[Tier] = []
        if device.type != "cpu":
            self.tiers.append(MemoryTier("device", device, config.device_budget))
        self.tiers.append(MemoryTier("host", "cpu", config.host_budget, pin=config.pin_memory))
        self.disk = DiskTier(config.spill_dir)
        self.tiers.append(self.disk)
        self._lock = threading.RLock()

    def __contains__(self, key: str) -> bool:
        with self._lock:
            return any(key in t for t in self.tiers)

    def put(self, key: str, kv: torch.Tensor) -> None:
        """Store a state in the fastest tier that can hold it; evict others down as needed."""
        with self._lock:
            if key in self:
                return
            self._insert(key, kv, 0)

    def get(self, key: str) -> tuple[torch.Tensor, str]:
        """(state, name of the tier it was found in). Promotes it to the fastest tier that fits."""
        with self._lock:
            for i, tier in enumerate(self.tiers):
                kv = tier.get(key)
                if kv is None:
                    continue
                top = self._top_fitting(nbytes(kv))
                if top < i:
                    kv = self._insert(key, kv, top)
                return kv, tier.name
        raise StoreError(f"no stored state for key {key[:16]}... (evicted with no disk copy?)")

    def register_file(self, path: Path, entries: dict[str, tuple[str, str, int]]) -> None:
        with self._lock:
            self.disk.add_file(path, entries)

    def usage(self) -> dict[str, int]:
        with self._lock:
            return {t.name: t.bytes_used for t in self.tiers}

    def tier_of(self, key: str) -> str | None:
        with self._lock:
            return next((t.name for t in self.tiers if key in t), None)

    # -- internals (lock held) -------------------------------------------------------------------
    def _top_fitting(self, n: int) -> int:
        return next(i for i, t in enumerate(self.tiers) if t.fits(n))

    def _insert(self, key: str, kv: torch.Tensor, start: int) -> torch.Tensor:
        i = max(start, self._top_fitting(nbytes(kv)))
        tier = self.tiers[i]
        tier.put(key, kv)
        self._fit(i)
        return tier.get(key) if key in tier else kv

    def _fit(self, i: int) -> None:
        """Evict least-recently-used states from tier i to the tier below until within budget."""
        tier, lower = self.tiers[i], self.tiers[i + 1 :]
        while tier.budget is not None and tier.bytes_used > tier.budget:
            victim = tier.lru()
            if victim is None:
                break
            kv = tier.evict(victim)
            if kv is not None and lower and not any(victim in t for t in lower):
                lower[0].put(victim, kv)
                self._fit(i + 1)
            log.debug("evicted %s from %s", victim[:12], tier.name)
