"""Module KV storage: tiers (device, host, disk; a remote byte tier plugs in) with budgets and
write policies, and the codec every stored byte goes through. See base.py for the tier contract."""

from .base import StoreError, Tier
from .bytetier import ByteTier
from .codec import CodecError, StateInfo, StatesFile
from .config import DEFAULT_PIN_BUDGET, StoreConfig
from .disk import DiskTier
from .memory import MemoryTier
from .pins import PinBudgetError, Pins
from .tiered import TieredStore, build_store

__all__ = ["DEFAULT_PIN_BUDGET", "ByteTier", "CodecError", "DiskTier", "MemoryTier", "PinBudgetError", "Pins", "StateInfo", "StatesFile", "StoreConfig",
           "StoreError", "Tier", "TieredStore", "build_store"]
