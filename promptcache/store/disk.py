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

Writes (``write_policy``): ``on_evict`` spills what memory evicts; ``through`` also writes every
new state at once, on the caller's thread; ``behind`` (``StoreConfig``'s default for a named
folder) queues every new state to a writer thread (``spillfolder.WriteBehind``), on disk within ``lag``
seconds, readable from the queue until then. Every file is written atomically (temp, fsync,
rename), so a killed process leaves whole files or none.

Thread safety: a lock guards the index and the handle cache; file I/O runs outside it.
The default spill folder is a temporary folder removed when the tier is collected or the process
exits.

A spill folder the caller names (``spill_dir``) persists: the tier owns it (``SpillFolder``: one
process at a time, temporary files of a killed writer removed, other files never touched) and
rebuilds its index from the states files there at start, least recently used first, so a
restarted replica serves what it stored before. The scan reads headers only (the data are
verified by the codec on first read, as for every file); a folder of more than
``SCAN_IN_BACKGROUND`` files is scanned in a thread (``wait_ready`` waits for it), and until it
ends a state not found yet is a miss (encoded again: content-addressed, so the same file).
``budget`` bounds the bytes of spill files (their sizes on disk); beyond it the least recently used are deleted
(``TieredStore`` evicts on every spill; the scan trims a folder left over budget, logged).
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
from .base import Tier, nbytes
from .config import DEFAULT_LAG, DISK_POLICIES
from .spillfolder import SpillFolder, WriteBehind

log = logging.getLogger(__name__)

OPEN_FILES = 128  # open handles kept (each is one memory mapping)
SCAN_IN_BACKGROUND = 1000  # states files in a named folder above which the start-up scan runs in a thread


@dataclass(frozen=True)
class FileState:
    """Where a registered state lives and what it must be: tensor ``name`` in ``path``."""

    path: Path
    name: str
    expect: codec.StateInfo
    nbytes: int = 0
    spilled: bool = False


def _weak_write(tier: "DiskTier"):
    """``tier.write_now`` without keeping ``tier`` alive (a state queued when it is collected is dropped)."""
    method = weakref.WeakMethod(tier.write_now)

    def write(key: str, kv: torch.Tensor) -> None:
        live = method()
        if live is not None:
            live(key, kv)

    return write


class DiskTier(Tier):
    name = "disk"
    io = True

    def __init__(self, spill_dir: str | Path | None = None, budget: int | None = None,
                 write_policy: str = "on_evict", lag: float = DEFAULT_LAG):
        """``write_policy``: ``on_evict``, ``through`` (every new state written at once) or
        ``behind`` (every new state queued to a writer thread, on disk within ``lag`` seconds)."""
        if budget is not None and budget < 0:
            raise ValueError(f"disk budget must be >= 0 bytes, got {budget}")
        if write_policy not in DISK_POLICIES:
            raise ValueError(f"disk write policy must be one of {', '.join(DISK_POLICIES)}, got {write_policy!r}")
        self.budget, self.write_policy = budget, write_policy
        self.writer = None
        if write_policy == "behind":  # the thread holds the tier weakly: a tier nobody holds is collected
            self.writer = WriteBehind(_weak_write(self), lag)
            weakref.finalize(self, self.writer.close)
        self._index: OrderedDict[str, FileState] = OrderedDict()  # LRU order
        self._files: OrderedDict[Path, codec.StatesFile] = OrderedDict()
        self._spilled = 0  # bytes of spill files indexed
        self._lock = threading.RLock()
        self._ready = threading.Event()
        self._folder = SpillFolder(spill_dir) if spill_dir else None
        self._spill_dir = self._folder.path if self._folder else None
        if self._folder is None:
            self._ready.set()
        else:
            weakref.finalize(self, self._folder.close)
            self._start_scan()

    @property
    def persistent(self) -> bool:
        """Whether the spill folder was named by the caller (kept across restarts)."""
        return self._folder is not None

    @property
    def spill_dir(self) -> Path:
        with self._lock:
            if self._spill_dir is None:
                self._spill_dir = Path(tempfile.mkdtemp(prefix="promptcache-spill-"))
                weakref.finalize(self, shutil.rmtree, str(self._spill_dir), True)
            return self._spill_dir

    def wait_ready(self, timeout: float | None = None) -> bool:
        """Wait for the start-up scan of a named folder; True when it has ended."""
        return self._ready.wait(timeout)

    def flush(self) -> None:
        """Write every state the writer has queued (``behind``); returns once they are on disk."""
        if self.writer is not None:
            self.writer.flush()

    def close(self) -> None:
        """Write what is queued, release a named folder's lock (after the scan); the index stays readable."""
        self._ready.wait()
        if self.writer is not None:
            self.writer.close()
        if self._folder is not None:
            self._folder.close()

    def _start_scan(self) -> None:
        self._folder.clean_temps()
        paths = self._folder.candidates()
        if len(paths) > SCAN_IN_BACKGROUND:
            log.info("spill folder %s: indexing %d files in the background", self._folder.path, len(paths))
            threading.Thread(target=self._scan, args=(paths,), name="promptcache-spill-scan", daemon=True).start()
        else:
            self._scan(paths)

    def _scan(self, paths: list[Path]) -> None:
        """Index the folder's states (oldest use first, before anything stored meanwhile), then trim
        to the budget."""
        try:
            found = self._folder.scan(paths)
            with self._lock:
                for f in reversed(found):
                    if f.key not in self._index:
                        self._index[f.key] = FileState(f.path, "kv", codec.StateInfo(f.key), f.nbytes, spilled=True)
                        self._index.move_to_end(f.key, last=False)
                        self._spilled += f.nbytes
                dropped = self._trim()
            log.info("spill folder %s: %d states (%d bytes) indexed%s", self._folder.path, len(found),
                     sum(f.nbytes for f in found), f", {dropped} least recently used deleted to fit the "
                     f"disk budget of {self.budget} bytes" if dropped else "")
        except Exception:  # noqa: BLE001 - a thread's failure must be seen; the tier still works without the old states
            log.exception("spill folder %s: indexing failed", self._folder.path)
        finally:
            self._ready.set()

    def _trim(self) -> int:
        """Delete least recently used spill files until within the budget (under the lock)."""
        n = 0
        while self.budget is not None and self._spilled > self.budget:
            victim = self.lru()
            if victim is None:
                break
            self._drop(victim)
            n += 1
        return n

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
                if self.writer is not None:
                    self.writer.discard(key)  # a queued copy is stale beside the file
                self._index[key] = FileState(path, name, expect, n)

    def get(self, key: str) -> torch.Tensor | None:
        with self._lock:
            entry = self._index.get(key)
            if entry is None:
                return self.writer.get(key) if self.writer is not None else None
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
        kv = handle.read(entry.name, entry.expect)
        if entry.spilled and self.persistent:
            SpillFolder.touch(entry.path)  # the LRU order a restart rebuilds
        return kv

    def put(self, key: str, kv: torch.Tensor) -> None:
        """Write ``kv`` to a spill file now, or queue it to the writer (``behind``; the caller
        hands ``kv`` over: it must not change afterwards)."""
        with self._lock:
            if key in self._index:
                return
        if self.writer is not None:
            self.writer.submit(key, kv)
        else:
            self.write_now(key, kv)

    def write_now(self, key: str, kv: torch.Tensor) -> None:
        """Write ``kv`` to ``<key>.safetensors`` atomically (temp file, fsync, rename) and index it."""
        with self._lock:
            if key in self._index:
                return
        path = self.spill_dir / f"{key}.safetensors"
        codec.write_file(path, {"kv": (key, kv)}, windows=self.windows)
        info = codec.StateInfo(key, str(kv.dtype).removeprefix("torch."), tuple(kv.shape))
        size = path.stat().st_size  # the budget counts the file (header and data)
        with self._lock:
            if key not in self._index:
                self._index[key] = FileState(path, "kv", info, size, spilled=True)
                self._spilled += size
            if self.writer is not None:
                self._trim()  # written behind the store's back: the store's budget check has passed

    def evict(self, key: str) -> torch.Tensor | None:
        with self._lock:
            self._drop(key)
        if self.writer is not None:
            self.writer.discard(key)
        return None

    def _drop(self, key: str) -> None:
        entry = self._index.pop(key, None)
        if entry is not None and entry.spilled:
            self._spilled -= entry.nbytes
            self._files.pop(entry.path, None)
            entry.path.unlink(missing_ok=True)

    def lru(self) -> str | None:
        with self._lock:
            return next((k for k, e in self._index.items() if e.spilled), None)

    @property
    def bytes_used(self) -> int:
        """Bytes of spill files on disk, and of states queued to be written (registered files are
        not this tier's to budget)."""
        queued = self.writer.bytes if self.writer is not None else 0
        with self._lock:
            return self._spilled + queued

    def __contains__(self, key: str) -> bool:
        return key in self._index or (self.writer is not None and key in self.writer)
