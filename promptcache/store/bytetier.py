"""A tier over a byte store shared by other processes (a remote key-value service), through the codec.

A subclass implements ``read`` / ``write`` / ``delete`` / ``exists`` of raw values (a Redis tier:
GET / SET / DEL / EXISTS, see ``remote.py``), and may override ``read_hashed`` to hash a value
while it arrives (``codec.Digest``). Values are ``codec.encode`` output of one state
named "kv", so a value carries its content key, dtype, shape and a checksum over all of them and
the data, and is verified on every fetch exactly like a disk state (a fetched state is promoted
to a local tier, so fetches are rare).

Decisions:
  * A value that fails verification is deleted (for every process) and is a miss: the caller
    encodes the state again. A shared value is a cache entry anyone may have damaged, not a
    file the user asked for, so it is never an error (``stats["corrupt"]`` counts them).
  * ``shared = True``: ``TieredStore`` keeps such tiers below every local tier, never asks them
    while deciding where an eviction goes (no network round trip under its lock) and never
    deletes their values when a local copy goes bad.
  * ``exists_many`` answers for many keys at once (one round trip in a subclass that can).
  * ``encode_lock`` (default: no coordination, always "encode it here") lets a subclass make two
    processes missing one state encode it once.
  * Eviction inside the service is the service's own (budget None, ``lru`` None).
"""

from __future__ import annotations

import logging
import threading
from abc import abstractmethod
from contextlib import contextmanager
from typing import Iterable, Iterator

import torch

from . import codec
from .base import Tier, check_policy, nbytes

log = logging.getLogger(__name__)

STATS = ("hits", "misses", "errors", "corrupt", "bytes_in", "bytes_out")


class ByteTier(Tier):
    io = True
    shared = True

    def __init__(self, name: str, write_policy: str = "through"):
        self.name, self.write_policy, self.budget = name, check_policy(write_policy), None
        self.where = name  # how log lines name the service (a subclass: its address, no password)
        self.stats = dict.fromkeys(STATS, 0)  # hits/misses of get, errors of the service, bytes moved
        self._bytes = 0
        self._stats_lock = threading.Lock()

    @abstractmethod
    def read(self, key: str) -> bytes | torch.Tensor | None:
        """The raw value (bytes-like, or a 1-D uint8 tensor), or None (absent, or the service
        unavailable)."""

    def read_hashed(self, key: str, name: str) -> tuple[bytes | torch.Tensor, codec.Digest | None] | None:
        """The raw value and, when the subclass hashed it as it arrived, the ``codec.Digest`` of
        its state ``name`` (then decoding does not hash the data again); None as for ``read``."""
        blob = self.read(key)
        return None if blob is None else (blob, None)

    @abstractmethod
    def write(self, key: str, value: bytes) -> bool:
        """Store the value; False when the service dropped it (unavailable, full)."""

    @abstractmethod
    def delete(self, key: str) -> None: ...

    @abstractmethod
    def exists(self, key: str) -> bool:
        """Whether a value is stored (unverified); False when the service is unavailable."""

    def exists_many(self, keys: Iterable[str]) -> set[str]:
        """The keys of ``keys`` that have a value (a subclass may answer in one round trip)."""
        return {k for k in keys if self.exists(k)}

    @contextmanager
    def encode_lock(self, key: str) -> Iterator[bool]:
        """Yields True when this process should encode ``key`` and publish it inside the block,
        False when another process published it meanwhile. Here: no coordination, always True."""
        yield True

    # -- the Tier interface -----------------------------------------------------------------------
    def get(self, key: str) -> torch.Tensor | None:
        """The verified state, or None (absent, unavailable, or bad: a bad value is deleted)."""
        got = self.read_hashed(key, "kv")
        kv = None
        if got is not None:
            try:
                kv = codec.decode(got[0], "kv", codec.StateInfo(key), got[1])
            except codec.CodecError as e:
                self.bad_value(key, str(e))
        self.count("hits" if kv is not None else "misses")
        if kv is not None:
            self.count("bytes_in", got[0].numel() if isinstance(got[0], torch.Tensor) else memoryview(got[0]).nbytes)
        return kv

    def put(self, key: str, kv: torch.Tensor) -> None:
        """Publish a state (a no-op when the service already holds it or drops the write)."""
        if self.exists(key):
            return  # content-addressed: the value there is this state
        value = codec.encode({"kv": (key, kv)}, windows=self.windows)[0]
        if self.write(key, value):
            self.count("bytes_out", len(value))
            with self._stats_lock:
                self._bytes += nbytes(kv)

    def evict(self, key: str) -> torch.Tensor | None:
        """Delete the value (for every process sharing the service); never returns a state."""
        self.delete(key)
        return None

    def lru(self) -> str | None:
        return None  # the service evicts by itself

    @property
    def bytes_used(self) -> int:
        """State bytes this process has published (the service's own total is not known here)."""
        return self._bytes

    def __contains__(self, key: str) -> bool:
        return self.exists(key)

    # -- for subclasses ---------------------------------------------------------------------------
    def bad_value(self, key: str, why: str) -> None:
        """Log, count and delete a value that is not the state stored under ``key``."""
        log.warning("shared tier %s: bad value for %s... (%s): deleted, treated as a miss", self.where, key[:16], why)
        self.count("corrupt")
        self.delete(key)

    def count(self, name: str, n: int = 1) -> None:
        with self._stats_lock:
            self.stats[name] += n
