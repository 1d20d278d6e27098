"""C++ CPU kernels compiled at first use in each Python environment: ``NativeKernels``.

Each kernel file (``kernels/attention.cpp``, ``kernels/rms_norm.cpp``, ``kernels/fused.cpp``)
is built with torch's C++ extension loader (the system's C++ compiler and ``ninja``;
``-O3 -march=native -fopenmp``) into a folder of this environment's own
(``kernels/build_folder.py``: ``~/.cache/promptcache/kernels/<python, torch, venv>/``, root
``PROMPTCACHE_KERNEL_DIR``), under a name keyed by the source, the flags, this CPU's flags and
torch's version: built once per environment (on 2 cores beside other work, load average 8-10:
the attention kernel 281 s, the norm and fused kernels 26 s each; the log says how long it took),
then a load of a few milliseconds. ``-march=native`` is why the build is per machine: the same source takes
AVX-512 (and AVX-512 BF16) where the CPU has it, AVX2 or SSE elsewhere. ``-fopenmp``: ATen's
``parallel_for`` is inline OpenMP, and the extension binds to the libgomp torch has already
loaded (one thread pool).

A build holds the folder's ``BuildLock``: a process that finds another one building (or loading)
the same kernel waits at most ``PROMPTCACHE_KERNEL_WAIT`` seconds (default 0), says so and keeps
torch's ops; a lock left by a killed builder is cleared with a log line. Where a kernel cannot be
built (no compiler, no ninja) a warning says why once, and its callers keep torch's own ops (the
same computation, slower); an environment variable per kernel turns it off
(``PROMPTCACHE_NATIVE_ATTENTION=0``, ``PROMPTCACHE_NATIVE_NORM=0``, ``PROMPTCACHE_NATIVE_FUSED=0``).
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch

from .build_folder import BuildBusy, BuildLock, build_folder, wait_seconds

log = logging.getLogger(__name__)

__all__ = ["NativeKernels"]

CFLAGS = ("-O3", "-march=native", "-fopenmp")
LOADING_WAIT_S = 30.0  # the longest wait on a lock held while a built kernel is loaded


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor()


class NativeKernels:
    """One C++ source registering ops under ``torch.ops.<namespace>``, built and loaded once per
    process on the first ``available()`` (thread-safe). ``what``: the kernels' name in log lines;
    ``switch``: the environment variable that turns them off; ``on_load(ops)``: called once after
    loading (e.g. to register fake implementations for torch.compile)."""

    def __init__(self, source: Path, namespace: str, what: str, switch: str,
                 on_load: Callable[[object], None] | None = None):
        self.source, self.namespace, self.what, self.switch, self.on_load = source, namespace, what, switch, on_load
        self._lock = threading.Lock()
        self._ops: object | None = None
        self._reason: str | None = None

    def available(self) -> bool:
        """Whether the kernels can be used (builds or loads them on the first call)."""
        if self._ops is not None or self._reason is not None:
            return self._ops is not None
        with self._lock:
            if self._ops is None and self._reason is None:
                self._load()
        return self._ops is not None

    @property
    def ops(self):
        """The loaded ``torch.ops`` namespace (call ``available()`` first)."""
        if self._ops is None:
            raise RuntimeError(f"{self.what}: not loaded ({self._reason or 'available() was not called'})")
        return self._ops

    def unavailable_reason(self) -> str | None:
        """Why the kernels are not used (None: they are, or were not asked for yet)."""
        return self._reason

    def build_name(self) -> str:
        """The extension's name: the source and the headers beside it (vectors.h: a header change
        rebuilds too), the flags, this CPU's flags and torch's version."""
        code = self.source.read_bytes() + b"".join(h.read_bytes() for h in sorted(self.source.parent.glob("*.h")))
        digest = hashlib.sha256(code + " ".join(CFLAGS).encode() + _cpu_flags().encode()
                                + torch.__version__.encode()).hexdigest()[:12]
        return f"promptcache_{self.source.stem}_{digest}"

    def _load(self) -> None:
        if os.environ.get(self.switch, "1").strip().lower() in ("0", "false", "no", "off"):
            self._reason = f"turned off by {self.switch}"
            log.info("%s %s; using torch's ops", self.what, self._reason)
            return
        try:
            self._ops = self._build()
        except BuildBusy as exc:  # never wait on another process's build without bound
            self._reason = str(exc)
            log.warning("%s: using torch's ops in this process (the next process loads the kernel)", exc)
        except Exception as exc:  # no compiler, no ninja, a failed build: torch's ops compute the same
            last = str(exc).strip().splitlines()[-1] if str(exc).strip() else ""
            self._reason = f"{type(exc).__name__}: {last}"
            log.warning("%s unavailable (%s); using torch's ops, slower on CPU (set %s=0 to silence this)",
                        self.what, self._reason, self.switch)

    def _build(self):
        from torch.utils import cpp_extension  # heavy: only when a kernel is wanted

        name = self.build_name()
        folder = build_folder(name)
        library = folder / f"{name}.so"
        t0 = time.perf_counter()
        # a built kernel's lock is held by a process loading it (ninja's check and a load: about a
        # second), worth waiting for; a build (minutes) is waited on only as PROMPTCACHE_KERNEL_WAIT says
        wait = max(wait_seconds(), LOADING_WAIT_S) if library.exists() else None
        with BuildLock(folder, self.what, wait):
            # built already: loaded as it is. Its name is the source's digest, so it is this source's
            # build; torch's loader runs ninja, whose build file names the source's path: the same
            # source in another checkout (worktrees sharing one environment) rebuilt it every time
            built = not (library.exists() and _loaded(library, self.what))
            if built:
                if not library.exists():
                    log.info("building the %s for this environment in %s (once; up to a few minutes "
                             "on a busy machine)", self.what, folder)
                cpp_extension.load(name=name, sources=[str(self.source)], build_directory=str(folder),
                                   extra_cflags=list(CFLAGS), extra_ldflags=["-fopenmp"], is_python_module=False,
                                   verbose=False)
        ops = getattr(torch.ops, self.namespace)
        if self.on_load is not None:
            self.on_load(ops)
        log.info("%s %s in %.1f s (%s)", self.what, "built" if built else "loaded",
                 time.perf_counter() - t0, folder)
        return ops


def _loaded(library: Path, what: str) -> bool:
    """Whether the built ``library`` loads (a library left unloadable is built again)."""
    try:
        torch.ops.load_library(str(library))
    except (OSError, RuntimeError) as exc:
        log.warning("the built %s (%s) does not load (%s): building it again", what, library, exc)
        return False
    return True
