"""Shared test set-up. Tests are grouped by layer, fastest first:

    tests/pml, tests/layout   language and layout: no torch, seconds
    tests/engine              exactness on tiny random-weight models of every family
    tests/store, tests/rag    storage tiers, artifacts, documents
    tests/e2e                 CLI, examples, eval studies and benchmarks (marked ``slow``)

``pytest -q`` runs everything (CI does); ``pytest -m "not slow"`` skips the end-to-end layer.
Helpers shared across layers (``tiny``, ``oracle``, ``pml_tokenizers``, ``programs``) live beside
this file and are importable from every folder (``pythonpath`` in pyproject.toml).

Tests that need a system program (a C++ compiler and ninja for the native kernels, redis-server,
chromium and its driver) carry ``@pytest.mark.programs(...)`` (``programs.py``): skipped, the
package to install named, where one is absent; failed under ``CI=true``.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

import programs

_HERE = Path(__file__).resolve().parent
FOLDER_PROGRAMS = {_HERE / "remote": ("redis-server", "redis-cli")}  # every test of the folder needs them


def pytest_collection_modifyitems(config, items):
    for item in items:
        parents = Path(str(item.fspath)).resolve().parents
        if (_HERE / "e2e") in parents:
            item.add_marker(pytest.mark.slow)
        for folder, names in FOLDER_PROGRAMS.items():
            if folder in parents:
                item.add_marker(programs.needs(*names))


def pytest_configure(config):
    # a native kernel being built by another process (another test run beside this one) is waited
    # on here rather than left to torch's ops: the kernel tests assert it is used
    os.environ.setdefault("PROMPTCACHE_KERNEL_WAIT", "900")


def pytest_runtest_setup(item):
    for mark in item.iter_markers("programs"):
        programs.require(*mark.args)


def pytest_runtest_logreport(report):
    """``PROMPTCACHE_FAILURE_LOG=FILE``: append each failure's report as it happens, so a run cut
    short (a lent GPU's time limit, eval/cuda_checks.sh) still says what failed and why. Written by
    the controlling process only when tests run in workers (pytest-xdist forwards their reports)."""
    path = os.environ.get("PROMPTCACHE_FAILURE_LOG")
    if not path or not report.failed or os.environ.get("PYTEST_XDIST_WORKER"):
        return
    text = report.longreprtext
    lines = text.splitlines()
    with open(path, "a", encoding="utf-8") as f:
        f.write(f"=== {report.nodeid} ({report.when})\n" + "\n".join(lines[:12] + ["..."] + lines[-40:]
                                                                     if len(lines) > 60 else lines) + "\n\n")
