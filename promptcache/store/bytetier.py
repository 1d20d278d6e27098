"""A tier over a byte store (a remote key-value service): bytes in and out through the codec.

A subclass implements ``read`` / ``write`` / ``delete`` / ``exists`` of raw values (a Redis tier:
GET / SET / DEL / EXISTS). Values are ``codec.encode`` output of one state named "kv", so a
value carries its content key, dtype, shape and checksum and is verified on every fetch (a
fetched state is promoted to a memory tier, so fetches are rare). A value that fails is refused
with ``CodecError``; ``TieredStore`` then evicts the key everywhere, which deletes the value.
Eviction inside the service is the service's own (budget None, ``lru`` None).
"""

from __future__ import annotations

from abc import abstractmethod

import torch

from . import codec
from .base import Tier, check_policy, nbytes


class ByteTier(Tier):
    io = True

    def __init__(self, name: str, write_policy: str = "through"):
        self.name, self.write_policy, self.budget = name, check_policy(write_policy), None
        self._bytes = 0

    @abstractmethod
    def read(self, key: str) -> bytes | None: ...

    @abstractmethod
    def write(self, key: str, value: bytes) -> None: ...

    @abstractmethod
    def delete(self, key: str) -> None: ...

    @abstractmethod
    def exists(self, key: str) -> bool: ...

    def get(self, key: str) -> torch.Tensor | None:
        blob = self.read(key)
        return None if blob is None else codec.decode(blob, "kv", codec.StateInfo(key))

    def put(self, key: str, kv: torch.Tensor) -> None:
        if not self.exists(key):
            self.write(key, codec.encode({"kv": (key, kv)})[0])
            self._bytes += nbytes(kv)

    def evict(self, key: str) -> torch.Tensor | None:
        self.delete(key)
        return None

    def lru(self) -> str | None:
        return None

    @property
    def bytes_used(self) -> int:
        """State bytes this process has written (the service's own total is not known here)."""
        return self._bytes

    def __contains__(self, key: str) -> bool:
        return self.exists(key)
