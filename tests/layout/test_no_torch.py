"""The language layer needs no torch: with torch and transformers made unimportable, the
language and layout tests are collected (their modules imported) and a schema and a prompt are
laid out."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BLOCKER = '''
import sys

class _Block:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("torch", "transformers"):
            raise ImportError(f"{name} is blocked: the language layer must not need it")
        return None

sys.meta_path.insert(0, _Block())
'''


def _run(args, tmp_path):
    (tmp_path / "block_torch.py").write_text(BLOCKER)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT), str(ROOT / "tests")])}
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


def test_language_tests_collect_without_torch(tmp_path):
    r = _run(["-m", "pytest", "--collect-only", "-q", "-p", "block_torch", "-p", "no:cacheprovider",
              "tests/pml", "tests/layout"], tmp_path)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert "error" not in r.stdout.lower().split("collected")[-1]


def test_layout_runs_without_torch(tmp_path):
    code = (
        "import block_torch\n"
        "from promptcache import layout_prompt, layout_schema\n"
        "from promptcache.builder import Schema, Prompt, module, ref\n"
        "from promptcache.tokens import WordTokenizer\n"
        "s = Schema('s', 'Hi ', module('a', 'alpha beta'))\n"
        "tok = WordTokenizer()\n"
        "pl = layout_prompt(Prompt(s, ref('a'), ' q?').tree(), layout_schema(s.tree(), tok), tok)\n"
        "print(pl.position_ids)\n"
    )
    r = _run(["-c", code], tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip() == "[0, 1, 2, 3, 4]"
