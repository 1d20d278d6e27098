"""File-system helpers: the one atomic write, and a folder lock.

``atomic_write(path, data)`` is how every promptcache file reaches disk (artifacts, manifests,
spill files, document stores): the bytes go to a temporary file in the same folder
(``.<name>.<random>.tmp``, created with mode 0o666 as the umask allows), the file is fsynced,
renamed over ``path`` (atomic on POSIX), and the folder is fsynced so the rename itself survives
a crash. A reader sees the old file or the new one, never a part. A failure (or a kill) removes
the temporary file where it can; a kill between create and rename may leave one ``*.tmp``
behind, which is never read and which writers may delete (``remove_stale_temps``).

``hold_lock(folder)`` takes the same lock without waiting and keeps it until the returned file is
closed (a process that owns a folder for its lifetime: a named spill folder); ``FolderBusy`` when
another holder has it.

``folder_lock(folder)`` is an exclusive advisory lock (``fcntl.flock`` on ``<folder>/.lock``)
held for a ``with`` block: writers of one artifact folder take it so that concurrent compiles
run one after the other. Where ``fcntl`` does not exist (Windows) it is a no-op (logged); in a
folder where the lock file cannot be created (read-only media) readers go on without it.
"""

from __future__ import annotations

import logging
import os
import secrets
from contextlib import contextmanager
from pathlib import Path

from .errors import PromptCacheError

log = logging.getLogger(__name__)

try:
    import fcntl
except ImportError:  # pragma: no cover - Windows
    fcntl = None

LOCK_NAME = ".lock"


def atomic_write(path: str | os.PathLike, data: bytes | str) -> Path:
    """Write ``data`` (str: UTF-8) to ``path`` atomically and durably; creates missing folders."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    raw = data.encode("utf-8") if isinstance(data, str) else data
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(raw)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_folder(path.parent)
    return path


def atomic_write_text(path: str | os.PathLike, text: str) -> Path:
    return atomic_write(path, text)


def fsync_folder(folder: Path) -> None:
    """Make a rename or unlink in ``folder`` durable (no-op where folders cannot be opened)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:  # pragma: no cover - Windows
        return
    try:
        os.fsync(fd)
    except OSError:  # pragma: no cover - some file systems refuse fsync on folders
        pass
    finally:
        os.close(fd)


def remove_stale_temps(folder: Path) -> None:
    """Delete temporary files a killed writer left in ``folder`` (only call under its lock)."""
    for stale in folder.glob(".*.tmp"):
        stale.unlink(missing_ok=True)


class FolderBusy(PromptCacheError, OSError):
    """Another process (or another open handle of this one) holds the folder's lock."""

    exit_code = 2


def hold_lock(folder: str | os.PathLike):
    """The open lock file of ``folder`` (created if missing), locked exclusively: close it to release.
    ``FolderBusy`` at once when another holder has the lock; None where ``fcntl`` does not exist."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    if fcntl is None:  # pragma: no cover
        log.warning("no fcntl: nothing stops two processes from sharing %s", folder)
        return None
    f = open(folder / LOCK_NAME, "a+b")
    try:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.close()
        raise FolderBusy(f"{folder} is in use (its lock {folder / LOCK_NAME} is held)") from None
    return f


@contextmanager
def folder_lock(folder: str | os.PathLike):
    """Hold an exclusive lock on ``folder`` (created if missing) for the ``with`` block."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    if fcntl is None:  # pragma: no cover
        log.warning("no fcntl: concurrent writers of %s are not serialized", folder)
        yield
        return
    try:
        f = open(folder / LOCK_NAME, "a+b")
    except OSError as e:  # a read-only folder (a shipped artifact): nobody can write it anyway
        log.debug("no lock on %s (%s): reading without it", folder, e)
        yield
        return
    with f:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)
