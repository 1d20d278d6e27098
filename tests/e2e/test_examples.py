"""The shipped examples run offline with the embedded model (their main() with small outputs)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def load(name):
    spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("name", ["quickstart", "rag", "chat"])
def test_example_runs_offline(name, capsys):
    args = ["--max-new-tokens", "2"] + (["--script"] if name == "chat" else [])
    load(name).main(args)
    out = capsys.readouterr().out
    assert "TTFT" in out and ("cached" in out or "from the cache" in out)


def test_bm25_retrieves_the_matching_document():
    rag = load("rag")
    bm = rag.BM25({"a": "bread dough rises with yeast", "b": "tides follow the moon", "c": "volcanoes erupt lava"})
    assert bm.search("why does dough rise", k=1) == ["a"]
    assert bm.search("moon and tides", k=2)[0] == "b"
