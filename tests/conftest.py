"""Shared test set-up. Tests are grouped by layer, fastest first:

    tests/pml, tests/layout   language and layout: no torch, seconds
    tests/engine              exactness on tiny random-weight models of every family
    tests/store, tests/rag    storage tiers, artifacts, documents
    tests/e2e                 CLI, examples, eval studies and benchmarks (marked ``slow``)

``pytest -q`` runs everything (CI does); ``pytest -m "not slow"`` skips the end-to-end layer.
Helpers shared across layers (``tiny``, ``oracle``, ``pml_tokenizers``) live beside this file and
are importable from every folder (``pythonpath`` in pyproject.toml).
"""

from __future__ import annotations

from pathlib import Path

import pytest

_HERE = Path(__file__).resolve().parent


def pytest_collection_modifyitems(config, items):
    for item in items:
        if (_HERE / "e2e") in Path(str(item.fspath)).resolve().parents:
            item.add_marker(pytest.mark.slow)
