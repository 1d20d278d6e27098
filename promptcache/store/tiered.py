"""Tiers stacked fastest first: LRU eviction down, promotion up on use, write-through where asked.

``TieredStore(tiers=[...])`` takes its tiers; ``build_store(device, StoreConfig)`` builds the
default stack: device memory (when the device is not the CPU), host memory, disk. Lookup runs
down the list (device -> host -> disk -> a remote tier when one is added); a hit below the top
is promoted to the fastest tier that can hold it.

Writes: ``put`` stores a state in the fastest tier that fits and in every lower tier whose
``write_policy`` is ``"through"``; a state evicted from a tier goes to the next lower tier unless
a lower tier already holds it (``"on_evict"``, write-back).

Locking: one lock guards the index (which tier holds what, LRU order, budgets). Tiers with
``io=True`` are read outside it, and write-through copies are written outside it; spill writes
on eviction happen under it, so a state is never absent from every tier while it moves down.
A state that fails verification (``StoreError`` from a tier) is dropped from every tier before
the error is raised, so the next ``add_schema`` re-encodes it and a good file can be registered.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from pathlib import Path

import torch

from ..errors import ConfigError
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
    spill_dir: str | None = None  # where evicted states go when no file holds them (default: a temp dir)
    pin_memory: bool = True  # pin host states when a GPU is used

    def __post_init__(self):
        for name in ("device_budget", "host_budget"):
            v = getattr(self, name)
            if v is not None and v < 0:
                raise ConfigError(f"{name} must be >= 0 bytes, got {v}")


def build_store(device: torch.device | str, config: StoreConfig | None = None) -> "TieredStore":
    """The default tiers: device memory (not on CPU), host memory, disk (all write-back)."""
    config, device = config or StoreConfig(), torch.device(device)
    tiers: list[Tier] = []
    if device.type != "cpu":
        tiers.append(MemoryTier("device", device, config.device_budget))
    tiers.append(MemoryTier("host", "cpu", config.host_budget, pin=config.pin_memory))
    tiers.append(DiskTier(config.spill_dir))
    return TieredStore(tiers)


class TieredStore:
    """get / put over the tiers; thread-safe."""

    def __init__(self, tiers: list[Tier]):
        names = [t.name for t in tiers]
        if not tiers or len(set(names)) != len(names):
            raise ValueError(f"a store needs at least one tier and distinct tier names, got {names}")
        self.tiers = list(tiers)
        self._lock = threading.RLock()

    def __contains__(self, key: str) -> bool:
        with self._lock:
            return any(key in t for t in self.tiers)

    def put(self, key: str, kv: torch.Tensor) -> None:
        """Store a state in the fastest tier that can hold it (evicting others down as needed)
        and in every write-through tier below it."""
        with self._lock:
            if any(key in t for t in self.tiers):
                return
            i = self._insert_at(key, kv, 0)
        for tier in self.tiers[i + 1 :]:
            if tier.write_policy == "through":
                tier.put(key, kv)

    def get(self, key: str) -> tuple[torch.Tensor, str]:
        """(state, name of the tier it was found in). Promotes it to the fastest tier that fits.
        Raises StoreError when no tier holds it or what a tier holds fails verification."""
        for i, tier in enumerate(self.tiers):
            if tier.io:
                kv = self._read(tier, key)
            else:
                with self._lock:
                    kv = tier.get(key)
            if kv is None:
                continue
            with self._lock:
                if i > self._top_fitting(nbytes(kv)) and not any(key in t for t in self.tiers[:i]):
                    kv = self._insert(key, kv, 0)
            return kv, tier.name
        raise StoreError(f"no stored state for key {key[:16]}... (evicted with no disk copy?)")

    def discard(self, key: str) -> None:
        """Drop ``key`` from every tier (spill files and remote values are deleted)."""
        with self._lock:
            for tier in self.tiers:
                tier.evict(key)

    def register_file(self, path: Path, entries: dict, opened=None) -> None:
        """Register states held in a file with the disk tier (see ``DiskTier.add_file``)."""
        disk = next((t for t in self.tiers if isinstance(t, DiskTier)), None)
        if disk is None:
            raise StoreError(f"cannot register {path}: this store has no disk tier")
        with self._lock:
            for tier in self.tiers:  # a stale copy elsewhere must not shadow the file
                if tier is not disk:
                    for key in entries:
                        tier.evict(key)
            disk.add_file(path, entries, opened)

    def fit(self) -> None:
        """Enforce every tier's budget now (after a budget was changed)."""
        with self._lock:
            for i in range(len(self.tiers)):
                self._fit(i)

    def usage(self) -> dict[str, int]:
        with self._lock:
            return {t.name: t.bytes_used for t in self.tiers}

    def tier_of(self, key: str) -> str | None:
        with self._lock:
            return next((t.name for t in self.tiers if key in t), None)

    # -- internals -------------------------------------------------------------------------------
    def _read(self, tier: Tier, key: str) -> torch.Tensor | None:
        """An io tier's read, outside the lock; on a verification failure drop the key everywhere."""
        try:
            return tier.get(key)
        except StoreError as e:
            log.warning("state %s failed verification in tier %s, dropped from every tier: %s",
                        key[:12], tier.name, e)
            self.discard(key)
            raise

    def _top_fitting(self, n: int) -> int:
        return next((i for i, t in enumerate(self.tiers) if t.fits(n)), len(self.tiers) - 1)

    def _insert_at(self, key: str, kv: torch.Tensor, start: int) -> int:
        i = max(start, self._top_fitting(nbytes(kv)))
        self.tiers[i].put(key, kv)
        self._fit(i)
        return i

    def _insert(self, key: str, kv: torch.Tensor, start: int) -> torch.Tensor:
        tier = self.tiers[self._insert_at(key, kv, start)]
        if key in tier and not tier.io:
            return tier.get(key)
        return kv

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
