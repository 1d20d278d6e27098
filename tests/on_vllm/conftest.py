"""tests/on_vllm: vLLM's CPU build with promptcache's connector (minutes: it installs and starts vLLM).
Marked ``vllm`` (left out of ``pytest -q`` by pyproject's addopts) and ``slow``; CI runs them as
their own step: ``python -m pytest -q -m vllm tests/on_vllm``."""

from __future__ import annotations

from pathlib import Path

import pytest

_HERE = Path(__file__).resolve().parent


def pytest_collection_modifyitems(config, items):
    for item in items:
        if _HERE in Path(str(item.fspath)).resolve().parents:
            item.add_marker(pytest.mark.vllm)
            item.add_marker(pytest.mark.slow)
