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

Models and inputs are built on the test device: the CPU, or what ``PROMPTCACHE_TEST_DEVICE`` names
(``cuda`` on a lent GPU, eval/cuda_checks.sh; the ``device`` fixture, ``tiny.DEVICE``). Tests of a
CPU-only feature carry ``@pytest.mark.cpu_only(refusal=...)``: on another device they check its
refusal there instead.
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


@pytest.fixture(scope="session")
def device():
    """The device tests build their models and inputs on: ``tiny.DEVICE`` as a ``torch.device``
    (``PROMPTCACHE_TEST_DEVICE``, the CPU unless set; eval/cuda_checks.sh sets ``cuda``). Models from
    tiny.py are on it; every tensor, pool or cache a test hands to one is built on it too."""
    import torch

    import tiny

    return torch.device(tiny.DEVICE)


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem):
    """``@pytest.mark.cpu_only(refusal=f)``: a test of a CPU-only feature (packed linears, the
    native CPU kernels inside an engine). On the CPU it runs as written; on another test device its
    body is not run and ``f()`` runs instead, checking that the feature refuses that device clearly
    (or stands aside), so the test still asserts something there rather than being skipped."""
    mark = pyfuncitem.get_closest_marker("cpu_only")
    if mark is None:
        return None
    import tiny

    if tiny.ON_CPU:
        return None
    refusal = mark.kwargs.get("refusal")
    if refusal is None:
        raise pytest.UsageError(f"{pyfuncitem.nodeid}: @pytest.mark.cpu_only needs refusal=, the check to run "
                                f"on {tiny.DEVICE} instead")
    refusal()
    return True


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
