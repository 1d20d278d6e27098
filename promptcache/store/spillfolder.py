"""A spill folder the user named: owned by one process, its states found again after a restart,
new ones written into it behind the requests.

``SpillFolder(path)`` takes the folder's lock for its owner's lifetime (``fsutil.hold_lock``), so
a second replica pointed at the same folder is refused with an error naming it (two owners would
delete each other's files under their own budgets). It deletes temporary files a killed writer
left (``.<name>.safetensors.<8 hex>.tmp``, see ``fsutil.atomic_write``), and ``scan()`` lists the
states it holds, least recently used first (file modification time: the disk tier touches a file
when it serves it, so the order survives a restart).

What is ours: ``<key>.safetensors`` whose header holds a state "kv" stored under that key (what
``DiskTier.put`` writes). A file named like a content key (64 hex digits) that is not such a file
is a damaged spill file: deleted, with a warning. Anything else in the folder is not ours and is
never touched (one log line says how many were left alone), so a folder the user names is never
emptied silently: only our states leave it, by budget (logged) or as damaged (logged).
Data are not read here: the codec verifies each state's checksum the first time it is read.

``WriteBehind`` is the disk tier's writer thread (``disk_policy="behind"``, the default for a
named spill folder): a new state is queued there and written by one thread (``write(key, kv)``: the codec's atomic
write, temp file, fsync, rename, folder fsync), so the request path pays no file write and a
killed process loses at most the last ``lag`` seconds of new states. The lag is bounded by
backpressure: ``submit`` waits while the oldest queued state has waited more than ``lag``
seconds (a disk slower than the states arriving slows their producer instead of growing the
queue and the loss without bound). Queued states stay readable (``get``) until written.

    writer = WriteBehind(tier.write_now, lag=2.0)
    writer.submit(key, kv)      # returns at once (unless the writer is ``lag`` behind)
    writer.flush()              # everything queued is on disk
    writer.close()              # flush, then the thread ends
"""

from __future__ import annotations

import logging
import os
import re
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from ..errors import PromptCacheError
from ..fsutil import FolderBusy, hold_lock
from . import codec
from .base import nbytes

log = logging.getLogger(__name__)

SUFFIX = ".safetensors"
_TEMP = re.compile(r"\..+\.safetensors\.[0-9a-f]{8}\.tmp")  # fsutil.atomic_write's temporary names
_KEY = re.compile(r"[0-9a-f]{64}")  # promptcache.keys' content keys (sha256 hex)


class SpillFolderBusy(PromptCacheError, RuntimeError):
    """Another process (or another store in this one) owns the spill folder."""

    exit_code = 2


@dataclass(frozen=True)
class Found:
    """A states file found in the folder: state "kv" of ``path`` is stored under ``key``."""

    key: str
    path: Path
    nbytes: int  # the file's size (what the disk budget counts)
    mtime: float


class SpillFolder:
    def __init__(self, path: str | Path):
        self.path = Path(path)
        try:
            self._lock = hold_lock(self.path)
        except FolderBusy as e:
            raise SpillFolderBusy(f"spill folder {self.path} is owned by another promptcache process ({e}); "
                                  "give each replica its own --spill-dir") from None
        except OSError as e:
            raise SpillFolderBusy(f"spill folder {self.path} cannot be used: {e}") from None

    def close(self) -> None:
        """Release the folder (another process may own it from now on)."""
        if self._lock is not None:
            self._lock.close()
            self._lock = None

    def file(self, key: str) -> Path:
        return self.path / f"{key}{SUFFIX}"

    def candidates(self) -> list[Path]:
        """The ``*.safetensors`` files in the folder (no header read: cheap)."""
        return [p for p in self.path.iterdir() if p.name.endswith(SUFFIX) and p.is_file()]

    def clean_temps(self) -> int:
        """Delete temporary files a killed writer left; returns how many."""
        stale = [p for p in self.path.iterdir() if _TEMP.fullmatch(p.name)]
        for p in stale:
            p.unlink(missing_ok=True)
        if stale:
            log.info("spill folder %s: removed %d temporary files a killed writer left", self.path, len(stale))
        return len(stale)

    def scan(self, paths: list[Path] | None = None) -> list[Found]:
        """The states in the folder, least recently used first (headers read, data not)."""
        found, foreign = [], 0
        for p in self.candidates() if paths is None else paths:
            got = self._read(p)
            if got is not None:
                found.append(got)
            elif _KEY.fullmatch(p.name[: -len(SUFFIX)]):
                log.warning("spill folder %s: %s is damaged (not the state its name says): deleted", self.path, p.name)
                p.unlink(missing_ok=True)
            else:
                foreign += 1
        if foreign:
            log.info("spill folder %s: %d files that are not promptcache spill files were left alone", self.path, foreign)
        return sorted(found, key=lambda f: f.mtime)

    def _read(self, p: Path) -> Found | None:
        key = p.name[: -len(SUFFIX)]
        try:
            rec = codec.state_record(codec.file_header(p), "kv")
            stat = p.stat()
        except (codec.CodecError, OSError):
            return None
        if rec is None or rec[0] != key:
            return None
        return Found(key, p, stat.st_size, stat.st_mtime)

    @staticmethod
    def touch(path: Path) -> None:
        """Mark a file as just used (its modification time orders eviction after a restart)."""
        try:
            os.utime(path)
        except OSError:  # gone meanwhile: the next read reports it
            pass


class WriteBehind:
    """Writes queued states on one daemon thread, oldest first; thread-safe."""

    def __init__(self, write: Callable[[str, torch.Tensor], None], lag: float,
                 name: str = "promptcache-disk-writer"):
        if not lag > 0:
            raise ValueError(f"the write-behind lag must be > 0 seconds, got {lag!r}")
        self.write, self.lag = write, float(lag)
        self._queue: OrderedDict[str, tuple[float, torch.Tensor]] = OrderedDict()  # key -> (queued at, state)
        self._busy: tuple[str, torch.Tensor, float] | None = None  # being written now (key, state, queued at)
        self._cv = threading.Condition()
        self._closed = False
        self._bytes = 0  # of the states queued or being written
        self.written = self.failed = 0  # counts, for logs and tests
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, key: str, kv: torch.Tensor) -> None:
        """Queue ``kv`` (the caller hands it over: it must not change afterwards); no-op when
        ``key`` is queued or being written. Waits while the writer is more than ``lag`` behind."""
        with self._cv:
            if key in self._queue or (self._busy is not None and self._busy[0] == key):
                return
            while (self._queue or self._busy) and not self._closed and time.monotonic() - self._oldest() > self.lag:
                self._cv.wait(0.05)
            if self._closed:  # after close: written here, on the caller's thread
                self._cv.release()
                try:
                    self._write(key, kv)
                finally:
                    self._cv.acquire()
                return
            self._queue[key] = (time.monotonic(), kv)
            self._bytes += nbytes(kv)
            self._cv.notify_all()

    def get(self, key: str) -> torch.Tensor | None:
        """A queued state not written yet, or None."""
        with self._cv:
            if self._busy is not None and self._busy[0] == key:
                return self._busy[1]
            entry = self._queue.get(key)
            return entry[1] if entry is not None else None

    def __contains__(self, key: str) -> bool:
        return self.get(key) is not None

    def discard(self, key: str) -> None:
        """Forget a queued state (evicted before it was written)."""
        with self._cv:
            entry = self._queue.pop(key, None)
            if entry is not None:
                self._bytes -= nbytes(entry[1])

    @property
    def bytes(self) -> int:
        """Bytes of the states queued or being written."""
        with self._cv:
            return self._bytes

    @property
    def pending(self) -> int:
        """States queued or being written."""
        with self._cv:
            return len(self._queue) + (self._busy is not None)

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every state queued before now is written; True when the queue is empty."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cv:
            while self._queue or self._busy is not None:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._cv.wait(left)
            return True

    def close(self) -> None:
        """Write what is queued, then end the thread (later submits write at once)."""
        self.flush()
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        self._thread.join()

    def _oldest(self) -> float:
        """When the oldest state not on disk yet was queued."""
        times = [next(iter(self._queue.values()))[0]] if self._queue else []
        if self._busy is not None:
            times.append(self._busy[2])
        return min(times)

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._queue and not self._closed:
                    self._cv.wait()
                if not self._queue:
                    return
                key, (queued, kv) = self._queue.popitem(last=False)
                self._busy = (key, kv, queued)
            self._write(key, kv)
            with self._cv:
                self._busy = None
                self._bytes -= nbytes(kv)
                self._cv.notify_all()

    def _write(self, key: str, kv: torch.Tensor) -> None:
        try:
            self.write(key, kv)
            self.written += 1
        except Exception:  # noqa: BLE001 - a state not written is computed again after a restart; the writer goes on
            self.failed += 1
            log.exception("write-behind of state %s failed", key[:12])
