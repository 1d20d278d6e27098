"""Where the native kernels are built, and who may build them: ``build_folder``, ``BuildLock``.

The folder belongs to one Python environment and one torch: ``<root>/<env_key()>/<name>``, the
root ``PROMPTCACHE_KERNEL_DIR`` (default ``~/.cache/promptcache/kernels``) and the key naming
the Python version, torch's version and a hash of ``sys.prefix``. torch's own extension folder is
shared by every venv on a machine, and two venvs with the same torch write different include
paths into its ``build.ninja``, so each rebuilt the other's kernel; here each venv keeps its own.

A build in a folder holds ``BuildLock``: an ``flock`` on ``build.lock`` (the kernel releases it
when its holder dies, however it dies), with the holder's pid written inside for messages. While
it is held, torch's own lock file (``lock``, which torch's loader waits on for as long as it
exists) can only be a leftover of a killed builder: it is removed with a log line. A process
that finds the lock held by another waits at most ``PROMPTCACHE_KERNEL_WAIT`` seconds (default
0; where the kernel is built already, up to 30 s: its holder is only loading it) and then says
so: the caller keeps torch's ops instead of hanging.
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import sys
import time
from pathlib import Path

import torch

from ..errors import PromptCacheError

log = logging.getLogger(__name__)

__all__ = ["ROOT_ENV", "WAIT_ENV", "BuildBusy", "BuildLock", "build_folder", "env_key", "wait_seconds"]

ROOT_ENV = "PROMPTCACHE_KERNEL_DIR"
WAIT_ENV = "PROMPTCACHE_KERNEL_WAIT"
TORCH_LOCK = "lock"  # torch.utils.cpp_extension's FileBaton in the build folder
POLL_S = 0.5


def env_key(prefix: str | None = None, torch_version: str | None = None) -> str:
    """``py<M><m>-torch<version>-<hash of the environment's prefix>``: one folder per venv and torch."""
    prefix = os.path.realpath(prefix if prefix is not None else sys.prefix)
    version = torch_version if torch_version is not None else torch.__version__
    tag = hashlib.sha256(prefix.encode()).hexdigest()[:10]
    return f"py{sys.version_info.major}{sys.version_info.minor}-torch{version.replace('+', '_')}-{tag}"


def build_folder(name: str, prefix: str | None = None) -> Path:
    """The folder kernel ``name`` is built in for this environment (``prefix``: ``sys.prefix``)."""
    root = os.environ.get(ROOT_ENV) or Path.home() / ".cache" / "promptcache" / "kernels"
    return Path(root) / env_key(prefix) / name


def wait_seconds() -> float:
    """``PROMPTCACHE_KERNEL_WAIT``: how long to wait on another process's build (seconds, default 0)."""
    raw = os.environ.get(WAIT_ENV, "0").strip() or "0"
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"{WAIT_ENV}={raw!r}: expected a number of seconds") from None
    if value < 0:
        raise ValueError(f"{WAIT_ENV}={raw!r}: expected a number of seconds >= 0")
    return value


class BuildBusy(PromptCacheError, RuntimeError):
    """Another live process holds the folder's build lock (past the wait allowed)."""

    exit_code = 2  # the environment: another process is building


class BuildLock:
    """``with BuildLock(folder, what):`` the only builder of ``folder`` on this machine, a stale
    torch lock cleared; raises ``BuildBusy`` when another process keeps it past ``wait`` seconds
    (default: ``PROMPTCACHE_KERNEL_WAIT``)."""

    def __init__(self, folder: Path, what: str, wait: float | None = None):
        self.folder, self.what = folder, what
        self.wait = wait_seconds() if wait is None else wait
        self.path = folder / "build.lock"
        self.fd: int | None = None

    def __enter__(self) -> "BuildLock":
        self.folder.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        deadline, told = time.monotonic() + self.wait, False
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                owner = _owner(fd)
                if time.monotonic() >= deadline:
                    os.close(fd)
                    raise BuildBusy(f"the {self.what} is being built by process {owner} in {self.folder} "
                                    f"(waited {self.wait:g} s; {WAIT_ENV}=SECONDS waits longer)") from None
                if not told:
                    log.info("waiting up to %g s for process %s building the %s in %s",
                             self.wait, owner, self.what, self.folder)
                    told = True
                time.sleep(POLL_S)
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self.fd = fd
        self._clear_stale_torch_lock()
        return self

    def __exit__(self, *exc) -> None:
        assert self.fd is not None
        os.ftruncate(self.fd, 0)
        fcntl.flock(self.fd, fcntl.LOCK_UN)
        os.close(self.fd)
        self.fd = None

    def _clear_stale_torch_lock(self) -> None:
        stale = self.folder / TORCH_LOCK
        try:
            age = time.time() - stale.stat().st_mtime
            stale.unlink()
        except FileNotFoundError:
            return
        log.warning("cleared a stale build lock %s (%.0f s old) left by a %s build that was killed; building again",
                    stale, age, self.what)


def _owner(fd: int) -> str:
    """The pid written by the lock's holder ('unknown' before it has written it)."""
    try:
        text = os.pread(fd, 32, 0).decode().strip()
    except OSError:
        text = ""
    return text if text.isdigit() else "unknown"
