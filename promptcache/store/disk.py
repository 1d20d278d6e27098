"""The disk tier: states in safetensors files (``codec`` format), memory-mapped, verified once.

Two kinds of files feed it: compiled artifacts and document stores (registered with
``add_file``, read-only here) and spill files this tier writes itself when a memory tier evicts
a state no file holds yet (``<key>.safetensors`` in the spill folder; deleted on eviction).

Reads: the file is opened once (``codec.StatesFile``, kept in a small LRU of open handles; the
mapping keeps a file readable after another writer replaces or removes it) and each state's
checksum is verified the first time it is read through that handle, never again while the handle
lives. Every read checks the header against what the reader registered (content key, dtype,
shape, model, checksum). Registering a file replaces any entry for the same keys (a stale or
corrupted one) and forgets the file's open handle, so it is verified afresh.

Thread safety: a lock guards the index and the handle cache; file I/O runs outside it.
The default spill folder is a temporary folder removed when the tier is collected or the process
exits.
"""

from __future__ import annotations

import logging
import shutil
import tempfile
import threading
import weakref
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import torch

from . import codec
from .base import Tier, check_policy, nbytes

log = logging.getLogger(__name__)

OPEN_FILES = 128  # open handles kept (each is one memory mapping)


@dataclass(frozen=True)
class FileState:
    """Where a registered state lives and what it must be: tensor ``name`` in ``path``."""

    path: Path
    name: str
    expect: codec.StateInfo
    nbytes: int = 0
    spilled: bool = False


class DiskTier(Tier):
    name = "disk"
    io = True

    def __init__(self, spill_dir: str | Path | None = None, budget: int | None = None,
                 write_policy: str = "on_evict"):
        self.budget, self.write_policy = budget, check_policy(write_policy)
        self._spill_dir = Path(spill_dir) if spill_dir else None
        self._index: OrderedDict[str, FileState] = OrderedDict()  # LRU order
        self._files: OrderedDict[Path, codec.StatesFile] = OrderedDict()
        self._lock = threading.RLock()

    @property
    def spill_dir(self) -> Path:
        with self._lock:
            if self._spill_dir is None:
                self._spill_dir = Path(tempfile.mkdtemp(prefix="promptcache-spill-"))
                weakref.finalize(self, shutil.rmtree, str(self._spill_dir), True)
            return self._spill_dir

    def add_file(self, path: str | Path, entries: dict[str, tuple[str, codec.StateInfo, int]],
                 opened: codec.StatesFile | None = None) -> None:
        """Register states held in ``path``: key -> (tensor name, expectation, nbytes).
        ``opened``: the file already opened by the caller (kept, so it stays readable)."""
        path = Path(path)
        with self._lock:
            self._files.pop(path, None)
            if opened is not None:
                self._files[path] = opened
            for key, (name, expect, n) in entries.items():
                self._drop(key)
                self._index[key] = FileState(path, name, expect, n)

    def get(self, key: str) -> torch.Tensor | None:
        with self._lock:
            entry = self._index.get(key)
            if entry is None:
                return None
            self._index.move_to_end(key)
            handle = self._files.get(entry.path)
            if handle is not None:
                self._files.move_to_end(entry.path)
        if handle is None:
            handle = codec.StatesFile(entry.path)  # header read: outside the lock
            with self._lock:
                handle = self._files.setdefault(entry.path, handle)
                while len(self._files) > OPEN_FILES:
                    self._files.popitem(last=False)
        return handle.read(entry.name, entry.expect)

    def put(self, key: str, kv: torch.Tensor) -> None:
        with self._lock:
            if key in self._index:
                return
        path = self.spill_dir / f"{key}.safetensors"
        codec.write_file(path, {"kv": (key, kv)})
        info = codec.StateInfo(key, str(kv.dtype).removeprefix("torch."), tuple(kv.shape))
        with self._lock:
            if key not in self._index:
                self._index[key] = FileState(path, "kv", info, nbytes(kv), spilled=True)

    def evict(self, key: str) -> torch.Tensor | None:
        with self._lock:
            self._drop(key)
        return None

    def _drop(self, key: str) -> None:
        entry = self._index.pop(key, None)
        if entry is not None and entry.spilled:
            self._files.pop(entry.path, None)
            entry.path.unlink(missing_ok=True)

    def lru(self) -> str | None:
        with self._lock:
            return next((k for k, e in self._index.items() if e.spilled), None)

    @property
    def bytes_used(self) -> int:
        """Bytes of spill files (registered files are not this tier's to budget)."""
        with self._lock:
            return sum(e.nbytes for e in self._index.values() if e.spilled)

    def __contains__(self, key: str) -> bool:
        return key in self._index
