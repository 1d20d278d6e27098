"""The storage contract: a tier holds module key/value states by content key.

Tiers (device memory, host memory, disk) share one small interface so ``TieredStore`` can move
states between them: get / put / evict / bytes used / integrity check. Keys are content
addresses (see ``keys.py``): equal keys mean equal states, so a state is stored once however many
schemas use it.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch


class StoreError(RuntimeError):
    """A stored state cannot be used (missing, truncated or corrupted)."""


class Tier(ABC):
    name: str
    budget: int | None  # bytes; None: unbounded

    @abstractmethod
    def get(self, key: str) -> torch.Tensor | None:
        """The state for ``key`` (marks it most recently used), or None when absent."""

    @abstractmethod
    def put(self, key: str, kv: torch.Tensor) -> None:
        """Store ``kv`` (copied to this tier's memory) under ``key``."""

    @abstractmethod
    def evict(self, key: str) -> torch.Tensor | None:
        """Remove ``key``; return its state if this tier held it in memory."""

    @abstractmethod
    def lru(self) -> str | None:
        """The least recently used key, or None when empty."""

    @property
    @abstractmethod
    def bytes_used(self) -> int: ...

    @abstractmethod
    def __contains__(self, key: str) -> bool: ...

    def check(self, key: str) -> bool:
        """Integrity check of one stored state (memory tiers trust themselves)."""
        return key in self

    def fits(self, nbytes: int) -> bool:
        return self.budget is None or nbytes <= self.budget


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()
