"""The storage contract: a tier holds module key/value states by content key.

Tiers (device memory, host memory, disk, later a remote store) share one small interface so
``TieredStore`` can move states between them: get / put / evict / lru / bytes used. Keys are
content addresses (see ``promptcache.keys``): equal keys mean equal states, so a state is stored
once however many schemas use it. States are tensors [L, 2, H, n, D] (layers, key/value, KV
heads, tokens, head dim).

Each tier declares:
  * ``write_policy``: ``"on_evict"`` (the default: it receives states evicted from the tier
    above, write-back) or ``"through"`` (it also receives every ``put``, write-through);
  * ``io``: True when ``get`` reads a file or the network. ``TieredStore`` calls such tiers
    outside its index lock, so they must guard their own index (memory tiers need not);
  * ``shared``: True when other processes read and write the same states (a remote service,
    ``ByteTier``). Shared tiers come after every local tier; ``write_policy`` then says when
    this process publishes: ``"through"`` on every ``put``, ``"on_evict"`` when a local memory
    tier evicts the state. A shared tier also answers ``exists_many(keys)`` and provides
    ``encode_lock(key)`` (``ByteTier`` does).
A local tier's ``get`` raises ``StoreError`` when what it holds fails verification; the store
then drops the key from every local tier so the state is re-encoded or reloaded. A shared tier
deletes a bad value itself and reports a miss.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Callable

import torch

from ..errors import PromptCacheError
from .config import WRITE_POLICIES


class StoreError(PromptCacheError, RuntimeError):
    """A stored state cannot be used (missing, truncated, corrupted, or not the state asked for)."""

    exit_code = 1


class Tier(ABC):
    name: str
    budget: int | None = None  # bytes; None: unbounded
    write_policy: str = "on_evict"
    io: bool = False
    shared: bool = False
    # the model's sliding window per layer, set (``build_store``) on tiers that serialize states when
    # ``StoreConfig.window_aware``: they then write only what a reader after a state can see
    # (store/codec.py, window-aware storage)
    windows: tuple[int | None, ...] | None = None

    @abstractmethod
    def get(self, key: str) -> torch.Tensor | None:
        """The state for ``key`` (marks it most recently used), or None when absent."""

    @abstractmethod
    def put(self, key: str, kv: torch.Tensor) -> None:
        """Store ``kv`` (copied to this tier's memory or medium) under ``key``; no-op if present."""

    @abstractmethod
    def evict(self, key: str) -> torch.Tensor | None:
        """Remove ``key``; return its state if this tier held it in memory (else None)."""

    @abstractmethod
    def lru(self) -> str | None:
        """The least recently used key this tier may evict, or None."""

    def lru_except(self, keep: Callable[[str], bool]) -> str | None:
        """The least recently used evictable key for which ``keep`` is false (pinned keys are kept).
        This default asks ``lru`` only; tiers with an LRU order override it to look past kept keys."""
        key = self.lru()
        return None if key is None or keep(key) else key

    @property
    @abstractmethod
    def bytes_used(self) -> int: ...

    @abstractmethod
    def __contains__(self, key: str) -> bool: ...

    def fits(self, nbytes: int) -> bool:
        return self.budget is None or nbytes <= self.budget


def check_policy(policy: str) -> str:
    if policy not in WRITE_POLICIES:
        raise ValueError(f"write policy must be one of {', '.join(WRITE_POLICIES)}, got {policy!r}")
    return policy


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()
