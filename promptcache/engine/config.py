"""``EngineConfig``: the engine's settings, one frozen dataclass validated on construction."""

from __future__ import annotations

from dataclasses import dataclass

from ..store import StoreConfig

__all__ = ["EngineConfig"]


@dataclass(frozen=True)
class EngineConfig:
    """Engine settings. Budgets are bytes of stored module states per tier (None: unbounded);
    on a CPU-only engine device memory is host memory and ``host_budget`` applies."""

    device: str | None = None  # default: the model's device
    encode_chunk: int = 2048  # tokens per forward while encoding the default pass
    encode_batch_bytes: int = 256 << 20  # KV bytes a batched encoding forward may allocate
    device_budget: int | None = None
    host_budget: int | None = None
    spill_dir: str | None = None  # evicted states with no artifact go here (default: a temp dir)
    pin_memory: bool = True
    namespace: str = "default"  # cache namespace (salt): states are never shared across namespaces

    def __post_init__(self):
        if self.encode_chunk < 1:
            raise ValueError(f"EngineConfig.encode_chunk must be >= 1, got {self.encode_chunk}")
        if self.encode_batch_bytes < 0:
            raise ValueError(f"EngineConfig.encode_batch_bytes must be >= 0, got {self.encode_batch_bytes}")

    def store_config(self) -> StoreConfig:
        return StoreConfig(self.device_budget, self.host_budget, self.spill_dir, self.pin_memory)
