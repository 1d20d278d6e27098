"""The disk tier: states in safetensors files, memory-mapped, checksummed, written atomically.

Two kinds of files feed it: compiled artifacts (registered with ``add_file``, read-only) and
spill files this tier writes itself when memory tiers evict a state that is on no disk yet
(``<key>.safetensors`` in the spill directory). Every read verifies the tensor's sha256 against
the value recorded when it was written; a mismatch or a truncated file raises ``StoreError``
and the state is never used.
"""

from __future__ import annotations

import hashlib
import logging
import os
import tempfile
from collections import OrderedDict
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from .base import StoreError, Tier

log = logging.getLogger(__name__)


def tensor_sha256(t: torch.Tensor) -> str:
    t = t.detach().contiguous().cpu()
    return hashlib.sha256(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"").hexdigest()


def atomic_save(tensors: dict[str, torch.Tensor], path: Path, metadata: dict[str, str] | None = None) -> None:
    """Write a safetensors file via a temporary file in the same folder, fsync, then rename."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        save_file({k: v.detach().contiguous().cpu() for k, v in tensors.items()}, tmp, metadata=metadata)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


class DiskTier(Tier):
    name = "disk"

    def __init__(self, spill_dir: str | Path | None = None, budget: int | None = None):
        self.budget = budget
        self._spill_dir = Path(spill_dir) if spill_dir else None
        # key -> (file, tensor name, sha256, nbytes); LRU order for spill eviction
        self._index: OrderedDict[str, tuple[Path, str, str, int]] = OrderedDict()
        self._spilled: set[str] = set()

    @property
    def spill_dir(self) -> Path:
        if self._spill_dir is None:
            self._spill_dir = Path(tempfile.mkdtemp(prefix="promptcache-spill-"))
        return self._spill_dir

    def add_file(self, path: Path, entries: dict[str, tuple[str, str, int]]) -> None:
        """Register states held in an existing file: key -> (tensor name, sha256, nbytes)."""
        for key, (name, sha, n) in entries.items():
            if key not in self._index:
                self._index[key] = (Path(path), name, sha, n)

    def get(self, key: str) -> torch.Tensor | None:
        entry = self._index.get(key)
        if entry is None:
            return None
        self._index.move_to_end(key)
        path, name, sha, _ = entry
        try:
            with safe_open(str(path), framework="pt") as f:
                t = f.get_tensor(name)
        except Exception as e:  # truncated, missing, or not a safetensors file
            raise StoreError(f"cannot read state '{name}' from {path}: {e}") from None
        if tensor_sha256(t) != sha:
            raise StoreError(f"checksum mismatch for state '{name}' in {path}: the file is corrupted")
        return t

    def put(self, key: str, kv: torch.Tensor) -> None:
        if key in self._index:
            return
        path = self.spill_dir / f"{key}.safetensors"
        atomic_save({"kv": kv}, path)
        self._index[key] = (path, "kv", tensor_sha256(kv), kv.numel() * kv.element_size())
        self._spilled.add(key)

    def evict(self, key: str) -> torch.Tensor | None:
        entry = self._index.pop(key, None)
        if entry is not None and key in self._spilled:
            self._spilled.discard(key)
            entry[0].unlink(missing_ok=True)
        return None

    def lru(self) -> str | None:
        return next((k for k in self._index if k in self._spilled), None)

    @property
    def bytes_used(self) -> int:
        return sum(self._index[k][3] for k in self._spilled)

    def __contains__(self, key: str) -> bool:
        return key in self._index

    def check(self, key: str) -> bool:
        try:
            return self.get(key) is not None
        except StoreError:
            return False
