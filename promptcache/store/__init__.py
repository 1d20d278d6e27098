"""Module KV storage tiers (device, host, disk) with budgets; see base.py for the tier contract."""

from .base import StoreError, Tier
from .disk import DiskTier
from .memory import MemoryTier
from .tiered import StoreConfig, TieredStore

__all__ = ["DiskTier", "MemoryTier", "StoreConfig", "StoreError", "Tier", "TieredStore"]
