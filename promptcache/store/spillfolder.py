"""A spill folder the user named: owned by one process, its states found again after a restart.

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
"""

from __future__ import annotations

import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path

from ..errors import PromptCacheError
from ..fsutil import FolderBusy, hold_lock
from . import codec

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
