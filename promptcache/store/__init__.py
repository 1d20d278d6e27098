"""Module KV storage: tiers (device, host, disk; a remote byte tier plugs in) with budgets and
write policies, and the codec every stored byte goes through. See base.py for the tier contract.

The names below are imported on first use (PEP 562), so ``from promptcache.store.config import
StoreConfig`` -- what the command line's options are built from -- needs no torch."""

_HOMES = {"StoreError": "base", "Tier": "base", "ByteTier": "bytetier", "CodecError": "codec", "StateInfo": "codec",
          "StatesFile": "codec", "DEFAULT_PIN_BUDGET": "config", "StoreConfig": "config", "DiskTier": "disk",
          "MemoryTier": "memory", "PinBudgetError": "pins", "Pins": "pins", "TieredStore": "tiered",
          "build_store": "tiered"}

__all__ = sorted(_HOMES)


def __getattr__(name: str):
    if name not in _HOMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from . import base, bytetier, codec, config, disk, memory, pins, tiered

    homes = {"base": base, "bytetier": bytetier, "codec": codec, "config": config, "disk": disk, "memory": memory,
             "pins": pins, "tiered": tiered}
    return getattr(homes[_HOMES[name]], name)
