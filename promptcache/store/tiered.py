"""Tiers stacked fastest first: LRU eviction down, promotion up on use, write-through where asked.

``TieredStore(tiers=[...])`` takes its tiers; ``build_store(device, StoreConfig)`` builds the
default stack: device memory (when the device is not the CPU), host memory, disk, and the shared
Redis tier when ``StoreConfig.remote`` names one. Lookup runs down the list (device -> host ->
disk -> remote); a hit below the top is promoted to the fastest tier that can hold it.

Writes: ``put`` stores a state in the fastest tier that fits and in every lower tier whose
``write_policy`` is ``"through"`` (or ``"behind"``: the disk tier's writer thread writes it within
seconds); ``keep`` hands such tiers a state that lives outside the store (a serving pool block); a state evicted from a tier goes to the next lower local tier
unless a lower local tier already holds it (``"on_evict"``, write-back). Shared tiers
(``tier.shared``, after every local tier) never take part in eviction decisions (no network
round trip under the lock); one with ``"on_evict"`` receives every state a local memory tier
evicts (published when it leaves this process's memory), written after the lock is released.

``ensure(keys, produce)`` is how the engine fills the store for a schema: keys a local tier holds
stay; keys a shared tier holds are left there (fetched, verified and promoted by the first
``get``, so a prompt's ``hit_tiers`` says ``remote``); the rest are produced once. With a
write-through shared tier that happens under its ``encode_lock``: two processes missing the same
states produce them once, the other waits and then finds them published.

Locking: one lock guards the index (which tier holds what, LRU order, budgets). Tiers with
``io=True`` are read outside it, and write-through copies are written outside it; spill writes
on eviction happen under it, so a state is never absent from every tier while it moves down.
A state that fails verification (``StoreError`` from a tier) is dropped from every tier before
the error is raised, so the next ``add_schema`` re-encodes it and a good file can be registered.
A shared tier never raises: it deletes a bad value itself and reports a miss.

Pins (``store.pins``, a ``Pins``; None: none): eviction from a tier skips keys whose pin is live,
so a tier may stay over its budget while pinned states fill it (the pin budget bounds that).
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path
from typing import Callable, Iterable

import torch

from .base import StoreError, Tier, nbytes
from .config import StoreConfig
from .disk import DiskTier
from .memory import MemoryTier
from .pins import Pins

log = logging.getLogger(__name__)


def build_store(device: torch.device | str, config: StoreConfig | None = None, windows=None) -> "TieredStore":
    """The default tiers: device memory (not on CPU), host memory, disk (all write-back), then the
    shared Redis tier when ``config.remote`` is set. ``windows``: the model's sliding window per
    layer; with ``config.window_aware`` the disk and Redis tiers write only what a later position
    can see of each state (``store/codec.py``, window-aware storage)."""
    config, device = config or StoreConfig(), torch.device(device)
    tiers: list[Tier] = []
    if device.type != "cpu":
        tiers.append(MemoryTier("device", device, config.device_budget))
    tiers.append(MemoryTier("host", "cpu", config.host_budget, pin=config.pin_memory))
    tiers.append(DiskTier(config.spill_dir, config.disk_budget, config.disk_write_policy, config.disk_lag))
    if config.remote is not None:
        tiers.append(_redis_tier(config.remote, config.remote_policy))
    if config.window_aware and windows and any(w is not None for w in windows):
        for tier in tiers:
            if tier.io:  # tiers that serialize: disk, Redis
                tier.windows = tuple(windows)
    return TieredStore(tiers)


def _redis_tier(url: str, policy: str) -> Tier:
    try:
        from .remote import RedisTier  # the redis client is optional: imported only when asked for
    except ModuleNotFoundError as e:
        if e.name != "redis":
            raise
        raise ImportError(f"a remote tier ({url.split('@')[-1]}) needs the redis client: "
                          'pip install "promptcache[remote]"') from None
    return RedisTier(url, policy)


class TieredStore:
    """get / put over the tiers; thread-safe."""

    def __init__(self, tiers: list[Tier]):
        names = [t.name for t in tiers]
        if not tiers or len(set(names)) != len(names):
            raise ValueError(f"a store needs at least one tier and distinct tier names, got {names}")
        kinds = [t.shared for t in tiers]
        if kinds != sorted(kinds) or all(kinds):
            raise ValueError(f"shared tiers must come after the local ones, and one tier at least must be "
                             f"local; got {[(t.name, 'shared' if t.shared else 'local') for t in tiers]}")
        self.tiers = list(tiers)
        self.local = [t for t in tiers if not t.shared]
        self.shared = [t for t in tiers if t.shared]
        self._lock = threading.RLock()
        self._outbox: list[tuple[Tier, str, torch.Tensor]] = []  # on_evict publications, sent outside the lock
        self.pins: Pins | None = None  # keys eviction skips while their pin lives (the server's cache_control)

    def __contains__(self, key: str) -> bool:
        """Whether any tier holds ``key`` (a shared tier: one round trip, unverified)."""
        with self._lock:
            if any(key in t for t in self.local):
                return True
        return any(key in t for t in self.shared)

    def put(self, key: str, kv: torch.Tensor) -> None:
        """Store a state in the fastest tier that can hold it (evicting others down as needed)
        and in every write-through tier below it."""
        with self._lock:
            if any(key in t for t in self.local):
                return
            i = self._insert_at(key, kv, 0)
        through = [j for j in range(i + 1, len(self.tiers)) if self.tiers[j].write_policy in ("through", "behind")]
        for j in through:
            self.tiers[j].put(key, kv)
        with self._lock:  # a write-through local tier (disk) may now be over its budget
            for j in through:
                if not self.tiers[j].shared:
                    self._fit(j)
        self._flush()

    @property
    def windows(self) -> tuple[int | None, ...] | None:
        """The sliding window per layer by which a tier trims what it writes
        (``StoreConfig.window_aware``; None: every tier keeps states whole)."""
        return next((t.windows for t in self.tiers if t.windows is not None), None)

    @property
    def keeps_new(self) -> bool:
        """Whether a local tier takes every new state (a disk tier ``through`` or ``behind``):
        then states that live elsewhere (the serving pool's blocks) are handed to ``keep``."""
        return any(t.write_policy in ("through", "behind") for t in self.local)

    def keep(self, key: str, kv: torch.Tensor) -> None:
        """Write a state held outside the store (a block the serving pool published) to the local
        tiers that take every new state, not to memory tiers (it has its memory in the pool), so a
        killed process finds it after a restart. ``kv`` is handed over: it must not change."""
        for tier in self.local:
            if tier.write_policy in ("through", "behind"):
                tier.put(key, kv)
        with self._lock:
            for i, tier in enumerate(self.tiers):
                if tier.write_policy == "through" and not tier.shared:
                    self._fit(i)

    def publish(self, key: str, kv: torch.Tensor) -> None:
        """Write a state to every shared tier whatever its policy (``promptcache compile --remote``)."""
        for tier in self.shared:
            tier.put(key, kv)

    def ensure(self, keys: Iterable[str], produce: Callable[[], dict[str, torch.Tensor]],
               fetch: bool = False) -> list[str]:
        """Make every key servable; returns the keys produced here (``produce()`` returns states
        by key, at least those; it is called at most once). See the module docstring.
        ``fetch=True`` fetches what shared tiers hold now (verified, promoted) instead of on first
        use, so a bad or vanished shared value is produced here at once (a prompt's retry)."""
        with self._lock:
            missing = [k for k in dict.fromkeys(keys) if not any(k in t for t in self.local)]
        missing = [k for k in missing if not self._fetched(k)] if fetch else self._not_shared(missing)
        lock_tier = next((t for t in self.shared if t.write_policy == "through"), None)
        if not missing or lock_tier is None:
            return self._produce(missing, produce)
        with lock_tier.encode_lock(missing[0]) as mine:
            if not mine:  # another process produced them meanwhile
                missing = self._not_shared(missing)
            return self._produce(missing, produce)

    def get(self, key: str) -> tuple[torch.Tensor, str]:
        """(state, name of the tier it was found in). Promotes it to the fastest tier that fits.
        Raises StoreError when no tier holds it or what a tier holds fails verification."""
        for i, tier in enumerate(self.tiers):
            if tier.io:
                kv = self._read(tier, key)
            else:
                with self._lock:
                    kv = tier.get(key)
            if kv is None:
                continue
            with self._lock:
                if i > self._top_fitting(nbytes(kv)) and not any(key in t for t in self.tiers[:i]):
                    kv = self._insert(key, kv, 0)
            self._flush()
            return kv, tier.name
        where = " or shared tier unavailable" if self.shared else ""
        raise StoreError(f"no stored state for key {key[:16]}... (evicted with no disk copy{where}?)")

    def discard(self, key: str) -> None:
        """Drop ``key`` from every local tier (spill files are deleted). Shared values stay: a
        local copy going bad says nothing about them, and a shared tier deletes its own bad values."""
        with self._lock:
            for tier in self.local:
                tier.evict(key)

    def register_file(self, path: Path, entries: dict, opened=None) -> None:
        """Register states held in a file with the disk tier (see ``DiskTier.add_file``)."""
        disk = self._disk()
        if disk is None:
            raise StoreError(f"cannot register {path}: this store has no disk tier")
        with self._lock:
            for tier in self.local:  # a stale copy elsewhere must not shadow the file
                if tier is not disk:
                    for key in entries:
                        tier.evict(key)
            disk.add_file(path, entries, opened)

    def persist(self) -> int:
        """Write the states only memory tiers hold to a named spill folder (``DiskTier.persistent``),
        as many of the most recently used as its budget admits, so a restart on that folder serves
        them; returns how many were written (0 without such a folder). Call it when the process
        stops (``promptcache serve`` does); states already on disk are not written again."""
        disk = self._disk()
        if disk is None or not disk.persistent:
            return 0
        with self._lock:
            held = [(k, t.get(k)) for t in reversed(self.local) if isinstance(t, MemoryTier) for k in t.keys()]
            held = [(k, kv) for k, kv in held if k not in disk]  # oldest first: host LRU .. device MRU
        room, chosen = disk.budget, []
        for key, kv in reversed(held):  # the most recently used first, while they fit
            if room is not None:
                if nbytes(kv) > room:
                    break
                room -= nbytes(kv)
            chosen.append((key, kv))
        for key, kv in reversed(chosen):  # written oldest first: the disk's LRU order matches
            disk.put(key, kv)
        disk.flush()  # written behind: on disk before this returns
        with self._lock:
            self._fit(self.tiers.index(disk))
        log.info("persisted %d states to %s", len(chosen), disk.spill_dir)
        return len(chosen)

    def close(self) -> None:
        """Release a named spill folder (another process may own it from now on)."""
        disk = self._disk()
        if disk is not None:
            disk.close()

    def fit(self) -> None:
        """Enforce every tier's budget now (after a budget was changed)."""
        with self._lock:
            for i in range(len(self.tiers)):
                self._fit(i)
        self._flush()

    def shared_stats(self) -> dict[str, int]:
        """The shared tiers' counters summed (``ByteTier.stats``: hits, misses, errors, corrupt,
        bytes_in, bytes_out); empty without a shared tier."""
        out: dict[str, int] = {}
        for tier in self.shared:
            for name, n in getattr(tier, "stats", {}).items():
                out[name] = out.get(name, 0) + n
        return out

    def usage(self) -> dict[str, int]:
        with self._lock:
            return {t.name: t.bytes_used for t in self.tiers}

    def describe(self) -> list[dict]:
        """Each tier, fastest first, as {name, shared, bytes, budget} (budget None: unbounded)."""
        with self._lock:
            return [{"name": t.name, "shared": t.shared, "bytes": t.bytes_used, "budget": t.budget}
                    for t in self.tiers]

    def tier_of(self, key: str) -> str | None:
        with self._lock:
            return next((t.name for t in self.tiers if key in t), None)

    # -- internals -------------------------------------------------------------------------------
    def _disk(self) -> DiskTier | None:
        return next((t for t in self.tiers if isinstance(t, DiskTier)), None)

    def _not_shared(self, keys: list[str]) -> list[str]:
        """The keys no shared tier holds (one ``exists_many`` per tier; unavailable: none held)."""
        for tier in self.shared:
            if keys:
                held = tier.exists_many(keys)
                keys = [k for k in keys if k not in held]
        return keys

    def _fetched(self, key: str) -> bool:
        try:
            self.get(key)
            return True
        except StoreError:
            return False

    def _produce(self, missing: list[str], produce) -> list[str]:
        if missing:
            states = produce()
            for key in reversed(missing):  # the first (a lock's key) published last: waiters see all
                self.put(key, states[key])
        return missing

    def _flush(self) -> None:
        """Send on_evict publications queued under the lock (network writes outside it)."""
        with self._lock:
            out, self._outbox = self._outbox, []
        for tier, key, kv in out:
            tier.put(key, kv)

    def _read(self, tier: Tier, key: str) -> torch.Tensor | None:
        """An io tier's read, outside the lock; on a verification failure drop the key everywhere."""
        try:
            return tier.get(key)
        except StoreError as e:
            log.warning("state %s failed verification in tier %s, dropped from every tier: %s",
                        key[:12], tier.name, e)
            self.discard(key)
            raise

    def _top_fitting(self, n: int) -> int:
        """The fastest local tier that can hold n bytes (the last local one when none can)."""
        return next((i for i, t in enumerate(self.local) if t.fits(n)), len(self.local) - 1)

    def _insert_at(self, key: str, kv: torch.Tensor, start: int) -> int:
        i = max(start, self._top_fitting(nbytes(kv)))
        self.tiers[i].put(key, kv)
        self._fit(i)
        return i

    def _insert(self, key: str, kv: torch.Tensor, start: int) -> torch.Tensor:
        tier = self.tiers[self._insert_at(key, kv, start)]
        if key in tier and not tier.io:
            return tier.get(key)
        return kv

    def _fit(self, i: int) -> None:
        """Evict least-recently-used states from tier i to the local tier below until within budget;
        queue them for on_evict shared tiers."""
        tier, lower = self.tiers[i], self.local[i + 1 :]
        while tier.budget is not None and tier.bytes_used > tier.budget:
            victim = tier.lru() if self.pins is None else tier.lru_except(self.pins.live)
            if victim is None:
                break
            kv = tier.evict(victim)
            if kv is not None and lower and not any(victim in t for t in lower):
                lower[0].put(victim, kv)
                self._fit(i + 1)
            if kv is not None:
                self._outbox += [(t, victim, kv) for t in self.shared if t.write_policy == "on_evict"]
            log.debug("evicted %s from %s", victim[:12], tier.name)
