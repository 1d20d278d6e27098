"""Names that moved still import, and say where they went (DeprecationWarning)."""

import importlib
import sys

import pytest


def test_promptcache_compiled_moved_into_the_engine():
    sys.modules.pop("promptcache.compiled", None)
    with pytest.warns(DeprecationWarning, match="promptcache.engine.compiled"):
        old = importlib.import_module("promptcache.compiled")
    from promptcache.engine import compiled

    assert old.load_compiled is compiled.load_compiled and old.compile_schema is compiled.compile_schema
