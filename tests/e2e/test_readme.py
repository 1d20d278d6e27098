"""The README's quick start and every python code block of README.md and docs/*.md, run as written
(issues 16 and 37).

The blocks are extracted from the files at test time, never copied here. Rules:

- Each file's python blocks run in document order in one namespace (a reader goes top to bottom: a
  later block may use ``pc`` from an earlier one of the same file), in a temp folder holding copies
  of the repository's ``schemas/`` and ``examples/``, offline (``HF_HUB_OFFLINE=1``), in a
  subprocess using this tree.
- Hub ids: where a block names a hub id (``from_pretrained("org/name")``, an ``org/name`` that is
  not a path in the temp folder) it is replaced by ``"embedded"``; nothing else is changed.
- A block right after ``<!-- readme-test: not run (reason) -->`` is not run (a running server,
  a Redis); the test checks each such marker gives a reason and that at most two exist per file.
- Every file of docs/ is linked from the README (the README is the map).
- The quick start (the first bash block): its ``python ...`` commands run as written (the
  install is the environment this test runs in; ``python -m pytest`` would run this test again).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
FILES = [README, *sorted((ROOT / "docs").glob("*.md"))]
BLOCK = re.compile(r"(<!-- readme-test: not run \((?P<why>[^)]*)\) -->\n)?```(?P<lang>\w*)\n(?P<body>.*?)```", re.S)
HUB_ID = re.compile(r'from_pretrained\("(?P<id>[A-Za-z0-9_.-]+/[A-Za-z0-9_.-]+)"')


def blocks(lang: str, path: Path = README) -> list[tuple[int, str, str | None]]:
    text = path.read_text(encoding="utf-8")
    return [(text[: m.start()].count("\n") + 1, m.group("body"), m.group("why"))
            for m in BLOCK.finditer(text) if m.group("lang") == lang]


@pytest.fixture
def folder(tmp_path):
    for d in ("schemas", "examples"):
        shutil.copytree(ROOT / d, tmp_path / d)
    return tmp_path


def env() -> dict:
    return {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


def offline(code: str, folder: Path) -> str:
    return HUB_ID.sub(lambda m: m.group(0) if (folder / m.group("id")).exists() else 'from_pretrained("embedded"',
                      code)


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.name)
def test_skipped_blocks_say_why(path):
    skipped = [(line, why) for line, _, why in blocks("python", path) if why is not None]
    assert len(skipped) <= 2 and all(why.strip() for _, why in skipped), skipped


def test_the_readme_is_a_map_of_the_docs():
    text = README.read_text(encoding="utf-8")
    assert len(text.splitlines()) <= 300
    unlinked = [p.name for p in FILES[1:] if f"](docs/{p.name})" not in text]
    assert not unlinked, f"docs not linked from README.md: {unlinked}"
    assert len([b for b in blocks("python") if b[2] is None]) >= 3  # layout printing, the API, RAG


@pytest.mark.parametrize("path", [f for f in FILES if any(why is None for _, _, why in blocks("python", f))],
                         ids=lambda p: p.name)
def test_every_python_block_runs_as_written(folder, path):
    runnable = [(line, body) for line, body, why in blocks("python", path) if why is None]
    name = path.relative_to(ROOT)
    script = "\n".join(f"# {name} line {line}\n{offline(body, folder)}" for line, body in runnable)
    (folder / "doc_blocks.py").write_text(script)
    (folder / "build").mkdir()
    res = subprocess.run([sys.executable, "doc_blocks.py"], cwd=folder, env=env(), capture_output=True,
                         text=True, timeout=900)
    assert res.returncode == 0, f"a block of {name} failed:\n{res.stderr[-3000:]}"


def test_quick_start_commands_run(folder):
    line, body, _ = blocks("bash")[0]
    commands = [c.strip() for ln in body.splitlines() if not ln.lstrip().startswith("#")
                for c in ln.split("&&")]
    runs = [c for c in commands if c.startswith("python ") and "-m pytest" not in c]
    assert runs, f"README.md:{line}: the quick start runs no python command"
    for c in runs:
        res = subprocess.run([sys.executable, *c.split()[1:]], cwd=folder, env=env(), capture_output=True,
                             text=True, timeout=600)
        assert res.returncode == 0, f"README.md:{line}: {c!r} failed:\n{res.stderr[-3000:]}"
