"""The shipped examples run offline with the embedded model (their main() with small outputs)."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def load(name):
    spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


# each example's statistics line: (ttft ms, cached tokens, new tokens)
STATS = {
    "quickstart": r"TTFT with Prompt Cache (?P<ms>[\d.]+) ms \((?P<cached>\d+) tokens cached, (?P<new>\d+) new\)",
    "rag": r"TTFT (?P<ms>[\d.]+) ms: (?P<cached>\d+) of (?P<total>\d+) prompt tokens reused from the cache, "
           r"(?P<recomputed>\d+) of the documents' tokens recomputed, (?P<new>\d+) new",
    "chat": r"\[TTFT (?P<ms>[\d.]+) ms, (?P<cached>\d+) cached / (?P<new>\d+) new tokens\]",
}


@pytest.mark.parametrize("name", ["quickstart", "rag", "chat"])
def test_example_runs_offline(name, capsys):
    args = ["--max-new-tokens", "2"] + (["--script"] if name == "chat" else [])
    load(name).main(args)
    out = capsys.readouterr().out
    stats = [m.groupdict() for m in re.finditer(STATS[name], out)]
    assert stats, f"no statistics line in the output of {name}:\n{out}"
    for s in stats:  # every prompt was served partly from stored states and ran some tokens
        assert float(s["ms"]) > 0 and int(s["cached"]) > 0 and int(s["new"]) > 0, s
        if "total" in s:  # reused + recomputed + new: every prompt token, once
            assert int(s["cached"]) + int(s["recomputed"]) + int(s["new"]) == int(s["total"]), s


def test_bm25_retrieves_the_matching_document():
    rag = load("rag")
    bm = rag.BM25({"a": "bread dough rises with yeast", "b": "tides follow the moon", "c": "volcanoes erupt lava"})
    assert bm.search("why does dough rise", k=1) == ["a"]
    assert bm.search("moon and tides", k=2)[0] == "b"
