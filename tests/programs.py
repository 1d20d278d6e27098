"""System programs some tests need, and what to install when one is missing.

``@pytest.mark.programs("redis-server", ...)`` (or ``require(...)`` in a fixture) skips a test
whose programs are not on PATH, the reason naming the Debian packages to install, so the README's
test command is green on a machine that has only Python; pytest's skip summary (``-rs``, in
pyproject's addopts) counts and lists them. Under CI (``CI`` set to true, as ``.ci/run`` does, which
installs every one of them) a missing program FAILS the test instead: CI never skips silently.
"""

from __future__ import annotations

import os
import shutil

import pytest

# program -> the Debian package that installs it
PACKAGES = {"chromium": "chromium", "chromedriver": "chromium-driver", "redis-server": "redis-server",
            "redis-cli": "redis-tools", "g++": "g++", "ninja": "ninja-build"}
COMPILER = ("g++", "ninja")  # the native kernels: torch's extension loader runs ninja and the C++ compiler


def missing(*programs: str) -> list[str]:
    unknown = [p for p in programs if p not in PACKAGES]
    assert not unknown, f"no package known for {unknown}: add it to PACKAGES"
    return [p for p in programs if shutil.which(p) is None]


def in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() in ("1", "true", "yes")


def require(*programs: str) -> None:
    """Skip the running test (fail it under CI) when any of ``programs`` is not on PATH."""
    absent = missing(*programs)
    if not absent:
        return
    packages = " ".join(dict.fromkeys(PACKAGES[p] for p in absent))
    message = f"needs {', '.join(absent)}: apt-get install {packages}"
    if in_ci():
        pytest.fail(f"{message} (CI=true: a missing program fails rather than skips)", pytrace=False)
    pytest.skip(message)


def needs(*programs: str) -> pytest.MarkDecorator:
    """The mark for a test or module (``pytestmark = needs(...)``)."""
    return pytest.mark.programs(*programs)
