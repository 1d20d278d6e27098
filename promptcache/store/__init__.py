"""Module KV storage: tiers (device, host, disk; a remote byte tier plugs in) with budgets and
write policies, and the codec every stored byte goes through. See base.py for the tier contract."""

from .base import StoreError, Tier
from .bytetier import ByteTier
from .codec import CodecError, StateInfo, StatesFile
from .disk import DiskTier
from .memory import MemoryTier
from .pins import PinBudgetError, Pins
from .tiered import StoreConfig, TieredStore, build_store

__all__ = ["ByteTier", "CodecError", "DiskTier", "MemoryTier", "PinBudgetError", "Pins", "StateInfo", "StatesFile", "StoreConfig",
           "StoreError", "Tier", "TieredStore", "build_store"]
