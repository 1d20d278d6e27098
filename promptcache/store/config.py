"""``StoreConfig``: the store's settings, the one owner of every byte budget of stored states.

Decisions: each budget has one setting. ``device_budget`` / ``host_budget`` bound the memory
tiers, ``disk_budget`` the spill folder, and ``pin_budget`` what the server's ``cache_control``
breakpoints may pin at once. Validated on construction: a bad value is a
``ConfigError`` naming ``StoreConfig.<field>``, raised before anything is built.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from ..errors import ConfigError
from ..settings import setting

__all__ = ["DEFAULT_PIN_BUDGET", "REMOTE_SCHEMES", "StoreConfig", "WRITE_POLICIES"]

WRITE_POLICIES = ("on_evict", "through")

DEFAULT_PIN_BUDGET = 1 << 30  # bytes of states cache_control breakpoints may pin at once
REMOTE_SCHEMES = ("redis://", "rediss://", "unix://", "redis+cluster://", "rediss+cluster://")


@dataclass(frozen=True)
class StoreConfig:
    """Byte budgets per tier (None: unbounded). On a CPU-only engine the device *is* host memory:
    there is one memory tier, named "host", with ``host_budget``. ``remote``: a Redis/Valkey URL
    whose tier is appended below disk (needs the ``redis`` client: the ``remote`` extra), with
    ``remote_policy`` "through" (publish every new state) or "on_evict" (publish what memory
    tiers evict)."""

    device_budget: int | None = setting(None, "Device memory for stored states (a size: 4GiB, 512MB; none: unbounded).")
    host_budget: int | None = setting(None, "Host memory for stored states (a size: 4GiB, 512MB; none: unbounded).")
    spill_dir: str | None = setting(
        None, "Folder for evicted states that have no artifact (default: a temp folder). A folder named here "
              "persists: a restart on it serves its states again.")
    pin_memory: bool = setting(True, "Pin host copies of states for fast device copies.")
    remote: str | None = setting(
        None, "Shared tier below disk: redis://[:password@]host:port/db or redis+cluster://host:port "
              "(default: this process only).")
    remote_policy: str = setting(
        "through", "through: publish every new state to --remote; on_evict: what memory evicts.")
    disk_budget: int | None = setting(
        None, "Disk for spill files in --spill-dir (a size: 20GiB; none: unbounded); least recently used deleted.")
    disk_policy: str = setting(
        "on_evict", "on_evict: states reach --spill-dir when memory evicts them (and at shutdown); through: at once "
                    "(survives a kill).")
    window_aware: bool = setting(
        False, "Disk and --remote keep of each state, in sliding-window layers (Gemma 3's local ones), only the "
               "tokens a later position can see: exact where every reader of a module sits after it (no parameter "
               "argument before it, nothing recomputed inside it).")
    pin_budget: int = setting(
        DEFAULT_PIN_BUDGET, "Memory that the server's cache_control breakpoints may pin at once (a size); a "
                            "request that would pin more is refused with a 400.")

    def __post_init__(self):
        for f in fields(self):
            v = getattr(self, f.name)
            if f.name.endswith("_budget") and v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 0):
                raise ConfigError(f"StoreConfig.{f.name} must be None or >= 0 bytes, got {v!r}")
        if self.pin_budget is None:
            raise ConfigError("StoreConfig.pin_budget must be >= 0 bytes, got None (the pin budget is never unbounded)")
        for name in ("remote_policy", "disk_policy"):
            if getattr(self, name) not in WRITE_POLICIES:
                raise ConfigError(f"StoreConfig.{name} must be one of {', '.join(WRITE_POLICIES)}, "
                                  f"got {getattr(self, name)!r}")
        if self.remote is not None and not str(self.remote).startswith(REMOTE_SCHEMES):
            raise ConfigError(f"StoreConfig.remote must be a redis:// (or redis+cluster://) URL, got {self.remote!r}")
