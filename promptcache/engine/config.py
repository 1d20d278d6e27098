"""``EngineConfig``: the engine's settings, one frozen dataclass validated on construction."""

from __future__ import annotations

import re
from dataclasses import dataclass

from ..errors import ConfigError
from ..store import StoreConfig
from .recompute import AUTO, DEFAULT_SELECTION, check_recompute, check_selection

__all__ = ["EngineConfig", "check_namespace"]

KV_DTYPES = (None, "float32", "bfloat16", "float16")
_NAMESPACE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:@-]{0,127}")


def check_namespace(namespace: object) -> str:
    """A valid namespace, or ConfigError (a ValueError). Namespaces salt every content key, so an empty or
    malformed one must never fall back to another tenant's (the default) states."""
    if not isinstance(namespace, str) or not _NAMESPACE.fullmatch(namespace):
        raise ConfigError(f"bad namespace {namespace!r}: expected 1-128 characters of letters, digits and "
                         "'._:@-', starting with a letter or digit (None means the engine's default namespace)")
    return namespace


@dataclass(frozen=True)
class EngineConfig:
    """Engine settings. Budgets are bytes of stored module states per tier (None: unbounded);
    on a CPU-only engine device memory is host memory and ``host_budget`` applies."""

    device: str | None = None  # default: the model's device
    encode_chunk: int = 2048  # tokens per forward while encoding the default pass
    encode_batch_bytes: int = 256 << 20  # KV bytes a batched encoding forward may allocate
    device_budget: int | None = None
    host_budget: int | None = None
    spill_dir: str | None = None  # evicted states with no artifact go here (default: a temp dir); a named folder persists
    disk_budget: int | None = None  # bytes of spill files in spill_dir (None: unbounded); the least recently used are deleted
    disk_policy: str = "on_evict"  # "through": every new state is written to spill_dir at once (survives a kill)
    pin_memory: bool = True
    overlap_copies: bool = False  # on a GPU, copy host-held states in layer groups on a side stream beside the forward (pays off when the GPU, not the CPU, bounds the forward)
    namespace: str = "default"  # cache namespace (salt): states are never shared across namespaces
    kv_dtype: str | None = None  # stored module states: None = the model's dtype, or "bfloat16" / "float16" / "float32"
    # drifted cached tokens computed afresh: "auto" (exact layouts none, drifted ones a measured
    # budget: engine/recompute.py AUTO_FRACTION) or a fraction (0: the paper's splice)
    recompute: float | str = AUTO
    recompute_selection: str = DEFAULT_SELECTION  # which cached tokens recompute chooses (engine/recompute.py SELECTIONS)
    remote: str | None = None  # shared tier below disk: "redis://[:password@]host:port/db" or "redis+cluster://host:port" (None: this process only)
    remote_policy: str = "through"  # publish to ``remote`` every new state ("through") or what memory evicts ("on_evict")
    # CPU, float32: every nn.Linear of the model computes through oneDNN with its weight packed once
    # (models/packed.py: ~2x faster decode steps on SmolLM2, within float32 rounding of the stock
    # forward; one more copy of the linear weights in memory)
    packed_linear: bool = False
    # serving steps of few tokens (decode, short prefills) run through torch.compile, padded to
    # buckets; CUDA graphs on a GPU (engine/graphs.py). Off by default: on CPU it was measured
    # no faster at batch 1 (the step is bound by reading the weights)
    compile: bool = False

    def __post_init__(self):
        if self.encode_chunk < 1:
            raise ConfigError(f"EngineConfig.encode_chunk must be >= 1, got {self.encode_chunk}")
        if self.encode_batch_bytes < 0:
            raise ConfigError(f"EngineConfig.encode_batch_bytes must be >= 0, got {self.encode_batch_bytes}")
        check_namespace(self.namespace)
        if self.kv_dtype not in KV_DTYPES:
            raise ConfigError(f"EngineConfig.kv_dtype must be one of {', '.join(map(str, KV_DTYPES))}, got {self.kv_dtype!r}")
        try:
            object.__setattr__(self, "recompute", check_recompute(self.recompute, "EngineConfig.recompute"))
        except ValueError as e:
            raise ConfigError(str(e)) from None
        check_selection(self.recompute_selection)
        if self.remote is not None and not str(self.remote).startswith(
                ("redis://", "rediss://", "unix://", "redis+cluster://", "rediss+cluster://")):
            raise ConfigError(f"EngineConfig.remote must be a redis:// (or redis+cluster://) URL, got {self.remote!r}")
        self.store_config()  # validates the store's fields (remote_policy) now, not when the engine starts

    def namespace_for(self, namespace: str | None) -> str:
        """The namespace a call uses: ``None`` means this config's; anything else must be valid
        (an empty string is an error, never the default)."""
        return self.namespace if namespace is None else check_namespace(namespace)

    def store_config(self) -> StoreConfig:
        return StoreConfig(self.device_budget, self.host_budget, self.spill_dir, self.pin_memory, self.remote,
                           self.remote_policy, self.disk_budget, self.disk_policy)
