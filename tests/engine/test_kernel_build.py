"""The native kernels' build folder and lock (kernels/build_folder.py), with a real build of a tiny
C++ op in subprocesses: one folder per environment (two venvs never rebuild each other's), a
builder killed mid-build leaves nothing that blocks the next process, and a build held by another
process is not waited on (torch's ops are used, the reason names the process)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from programs import COMPILER, needs
from promptcache.kernels.build import NativeKernels
from promptcache.kernels.build_folder import BuildLock, build_folder, env_key

pytestmark = [pytest.mark.slow, needs(*COMPILER)]

TINY = """#include <torch/library.h>
#include <ATen/ATen.h>
at::Tensor twice(const at::Tensor& x) { return x * 2; }
TORCH_LIBRARY(promptcache_tiny, m) { m.def("twice(Tensor x) -> Tensor", &twice); }
"""

SCRIPT = """import logging, sys
sys.prefix = {prefix!r}  # another venv, as far as the build folder is concerned
logging.basicConfig(level=logging.INFO, stream=sys.stdout, format="%(message)s")
from pathlib import Path
import torch
from promptcache.kernels.build import NativeKernels
k = NativeKernels(Path({source!r}), "promptcache_tiny", "tiny kernel", "PROMPTCACHE_TINY")
print("AVAILABLE", k.available(), k.unavailable_reason(), flush=True)
print("TWICE", torch.ops.promptcache_tiny.twice(torch.ones(2)).tolist())
"""


@pytest.fixture
def tiny(tmp_path, monkeypatch):
    source = tmp_path / "tiny.cpp"
    source.write_text(TINY)
    monkeypatch.setenv("PROMPTCACHE_KERNEL_DIR", str(tmp_path / "kernels"))
    monkeypatch.setenv("PROMPTCACHE_KERNEL_WAIT", "0")
    return source


def _start(source: Path, prefix: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", SCRIPT.format(prefix=prefix, source=str(source))],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)


def _run(source: Path, prefix: str) -> str:
    proc = _start(source, prefix)
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, out
    assert "AVAILABLE True" in out and "TWICE [2.0, 2.0]" in out, out
    return out


def _folder(source: Path, prefix: str) -> Path:
    return build_folder(NativeKernels(source, "promptcache_tiny", "tiny kernel", "X").build_name(), prefix)


def test_env_key_is_per_prefix_and_torch():
    assert env_key("/venvs/a") == env_key("/venvs/a")
    assert env_key("/venvs/a") != env_key("/venvs/b")
    assert env_key("/venvs/a", "2.13.0") != env_key("/venvs/a", "2.12.0")


def test_two_environments_do_not_rebuild_each_other(tiny, tmp_path):
    a, b = str(tmp_path / "venv-a"), str(tmp_path / "venv-b")
    assert "tiny kernel built in" in _run(tiny, a)
    so_a = next(_folder(tiny, a).glob("*.so"))
    stamp = so_a.stat().st_mtime_ns
    assert "tiny kernel built in" in _run(tiny, b)
    assert _folder(tiny, a) != _folder(tiny, b)
    again = _run(tiny, a)
    assert "tiny kernel loaded in" in again and "building" not in again, again
    assert so_a.stat().st_mtime_ns == stamp


def test_the_same_source_in_another_checkout_loads_the_built_kernel(tiny, tmp_path):
    """Worktrees share one environment: the same source at another path is the same kernel (its
    name is the source's digest), loaded as built, not rebuilt (torch's ninja file names the
    source's path: it rebuilt each checkout's kernel over the other's)."""
    prefix = str(tmp_path / "venv")
    assert "tiny kernel built in" in _run(tiny, prefix)
    other = tmp_path / "checkout" / "tiny.cpp"
    other.parent.mkdir()
    other.write_text(tiny.read_text())
    assert _folder(other, prefix) == _folder(tiny, prefix)
    so = next(_folder(tiny, prefix).glob("*.so"))
    stamp = so.stat().st_mtime_ns
    again = _run(other, prefix)
    assert "tiny kernel loaded in" in again and "building" not in again, again
    assert so.stat().st_mtime_ns == stamp


def test_a_killed_build_does_not_block_the_next_process(tiny, tmp_path):
    prefix = str(tmp_path / "venv")
    folder = _folder(tiny, prefix)
    proc = _start(tiny, prefix)
    deadline = time.monotonic() + 120
    while not (folder / "lock").exists():  # torch's lock: the compiler is running
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[0]
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)  # the builder, its ninja and compiler
    proc.wait()
    assert (folder / "lock").exists()  # left behind: torch's loader would wait on it forever
    out = _run(tiny, prefix)
    assert "cleared a stale build lock" in out and "tiny kernel built in" in out, out


def test_a_build_running_elsewhere_is_not_waited_on(tiny):
    folder = _folder(tiny, sys.prefix)
    kernels = NativeKernels(tiny, "promptcache_tiny", "tiny kernel", "PROMPTCACHE_TINY")
    with BuildLock(folder, "tiny kernel", wait=0):  # as another process's build holds it
        t0 = time.monotonic()
        assert not kernels.available()
        assert time.monotonic() - t0 < 5
    reason = kernels.unavailable_reason()
    assert f"being built by process {os.getpid()}" in reason and "PROMPTCACHE_KERNEL_WAIT" in reason, reason


def test_a_built_kernel_being_loaded_elsewhere_is_waited_for(tiny):
    """Where the kernel is built already, the lock's holder is only loading it: worth a short wait
    (two processes starting at once both get the kernel), even with PROMPTCACHE_KERNEL_WAIT=0."""
    _run(tiny, sys.prefix)  # built in this environment's folder
    held = BuildLock(_folder(tiny, sys.prefix), "tiny kernel", wait=0).__enter__()
    threading.Timer(1.0, held.__exit__, (None, None, None)).start()
    t0 = time.monotonic()
    kernels = NativeKernels(tiny, "promptcache_tiny", "tiny kernel", "PROMPTCACHE_TINY")
    assert kernels.available(), kernels.unavailable_reason()
    assert time.monotonic() - t0 >= 0.9
