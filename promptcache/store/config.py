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

__all__ = ["DEFAULT_LAG", "DEFAULT_PIN_BUDGET", "DISK_POLICIES", "REMOTE_SCHEMES", "StoreConfig", "WRITE_POLICIES"]

WRITE_POLICIES = ("on_evict", "through")  # a shared tier's
DISK_POLICIES = ("on_evict", "through", "behind")  # the disk tier's
DEFAULT_LAG = 2.0  # seconds a write-behind state may wait for the disk

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
    disk_policy: str | None = setting(
        None, "behind: every new state is queued to a writer thread and reaches --spill-dir within --disk-lag "
              "seconds (a kill loses at most those); through: written at once on the request path; on_evict: when "
              "memory evicts it (and at shutdown). Default: behind with --spill-dir, else on_evict.")
    disk_lag: float = setting(
        DEFAULT_LAG, "Write-behind: seconds a new state may wait for the disk; beyond it new states wait for the "
                     "writer (the most a kill loses).")
    window_aware: bool = setting(
        True, "Disk and --remote keep of each state, in sliding-window layers (Gemma 3's local ones), only the "
              "tokens a reader after it can see (models without such layers: no effect). A prompt with a reader "
              "before a module (text before the first reference, a parameter argument, a recomputed token) "
              "encodes the states it needs again: always exact.")
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
        if self.remote_policy not in WRITE_POLICIES:
            raise ConfigError(f"StoreConfig.remote_policy must be one of {', '.join(WRITE_POLICIES)}, "
                              f"got {self.remote_policy!r}")
        if self.disk_policy is not None and self.disk_policy not in DISK_POLICIES:
            raise ConfigError(f"StoreConfig.disk_policy must be one of {', '.join(DISK_POLICIES)} (or None: the "
                              f"default), got {self.disk_policy!r}")
        if isinstance(self.disk_lag, bool) or not isinstance(self.disk_lag, (int, float)) or not self.disk_lag > 0:
            raise ConfigError(f"StoreConfig.disk_lag must be > 0 seconds, got {self.disk_lag!r}")
        if self.remote is not None and not str(self.remote).startswith(REMOTE_SCHEMES):
            raise ConfigError(f"StoreConfig.remote must be a redis:// (or redis+cluster://) URL, got {self.remote!r}")

    @property
    def disk_write_policy(self) -> str:
        """``disk_policy``, its default resolved: ``behind`` for a named spill folder (a temporary
        one does not outlive the process), else ``on_evict``."""
        if self.disk_policy is not None:
            return self.disk_policy
        return "behind" if self.spill_dir else "on_evict"
