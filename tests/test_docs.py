"""The docs agree with the code: every link and named section they point to exists, every
``module.NAME`` they cite is importable, every file they name ships, and every schema their
examples use ships (or is defined beside the example).

Scanned: README.md, docs/*.md, eval/README.md. A "named section" is a heading, or the bold label
of a list item (``- **Compiled steps** ...``: eval/README.md's results), cited as
``[eval/README.md](../eval/README.md) "Compiled steps"`` or ``eval/README.md, "CUDA"``."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "eval" / "README.md"]
PACKAGE = ROOT / "promptcache"
SUBMODULES = {p.stem for p in PACKAGE.iterdir() if (p.suffix == ".py" or (p / "__init__.py").exists())
              and not p.name.startswith("_")}

LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
HEADING = re.compile(r"^#{1,6}\s+(.+?)\s*#*$", re.M)
LABEL = re.compile(r"^\s*[-*]\s+\*\*(.+?)\*\*", re.M)
SECTION_REF = re.compile(r"([\w./-]+\.md)(?:\]\([^)\s]+\))?,?\s+(?:section\s+)?\"([A-Z][^\"\n]{1,60})\"")
SEE = re.compile(r"\(see \"([A-Z][^\"\n]{1,60})\"\)")
CITED = re.compile(r"`((?:promptcache|eval)(?:\.\w+)+|[a-z_]+(?:\.\w+)+)`")
FENCE = re.compile(r"^```[^\n]*\n(.*?)^```", re.M | re.S)
USES_SCHEMA = re.compile(r"<prompt\s+schema=\"([\w-]+)\"")
DEFINES_SCHEMA = re.compile(r"<schema\s+name=\"([\w-]+)\"")
SHIPPED_FILE = re.compile(r"(?<![\w./-])((?:schemas|examples)/[\w./-]+\.(?:xml|py|txt))")


def _text(path: Path) -> str:
    return FENCE.sub(lambda m: "\n" * m.group(0).count("\n"), path.read_text(encoding="utf-8"))  # prose only


def slug(heading: str) -> str:
    """GitHub's anchor of a heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def sections(path: Path) -> set[str]:
    text = _text(path)
    return {h.strip("`").rstrip(".") for h in HEADING.findall(text)} | {x.rstrip(".") for x in LABEL.findall(text)}


def anchors(path: Path) -> set[str]:
    return {slug(h) for h in HEADING.findall(_text(path))}


def _rel(doc: Path) -> str:
    return str(doc.relative_to(ROOT))


def _resolve(doc: Path, target: str) -> Path | None:
    for base in (doc.parent, ROOT):  # relative to the doc, or (in prose) to the repository
        p = (base / target).resolve()
        if p.exists():
            return p
    return None


def test_every_link_and_anchor_exists():
    bad = []
    for doc in DOCS:
        for target in LINK.findall(_text(doc)):
            if re.match(r"[a-z]+:", target):  # https:, mailto:
                continue
            path, _, anchor = target.partition("#")
            dest = _resolve(doc, path) if path else doc
            if dest is None:
                bad.append(f"{_rel(doc)}: link to {target}: no such file")
            elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                bad.append(f"{_rel(doc)}: link to {target}: no heading with that anchor in {_rel(dest)}")
    assert not bad, "\n".join(bad)


def test_every_named_section_exists():
    bad = []
    for doc in DOCS:
        text = _text(doc)
        cited = [(path, name) for path, name in SECTION_REF.findall(text)]
        cited += [(doc.name, name) for name in SEE.findall(text)]
        for path, name in cited:
            dest = doc if path == doc.name else _resolve(doc, path)
            if dest is None:
                bad.append(f"{_rel(doc)}: {path} \"{name}\": no such file")
            elif name not in sections(dest):
                bad.append(f"{_rel(doc)}: {path} \"{name}\": no such section (sections: {sorted(sections(dest))})")
    assert not bad, "\n".join(bad)


LOGGERS = set(re.findall(r"getLogger\(\"([\w.]+)\"\)", "".join(
    p.read_text(encoding="utf-8") for p in PACKAGE.rglob("*.py"))))  # named loggers, cited as such


def _module_file(parts: list[str]) -> bool:
    path = ROOT.joinpath(*parts)
    return path.with_suffix(".py").exists() or (path / "__init__.py").exists()


def _importable(dotted: str) -> bool:
    parts = dotted.split(".")
    if parts[0] == "eval":
        return _module_file(parts[:2])
    if parts[0] != "promptcache":
        parts = ["promptcache", *parts]
    if dotted in LOGGERS or _module_file(parts):  # a module (its optional dependencies need not be here)
        return True
    for n in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:n]))
        except ImportError:
            continue
        try:
            for name in parts[n:]:
                obj = getattr(obj, name)
        except AttributeError:
            return False
        return True
    return False


def test_every_cited_module_name_exists():
    bad = []
    for doc in DOCS:
        for dotted in set(CITED.findall(doc.read_text(encoding="utf-8"))):
            first = dotted.split(".")[0]
            if first not in SUBMODULES | {"promptcache", "eval"} or re.search(r"\.(py|md|xml|json|txt|toml|sh|csv|png|safetensors)$", dotted):
                continue
            if not _importable(dotted):
                bad.append(f"{_rel(doc)}: `{dotted}` is not an importable name")
    assert not bad, "\n".join(bad)


def test_every_shipped_file_and_schema_a_doc_uses_exists():
    shipped = {m for p in (ROOT / "schemas").glob("*.xml") for m in DEFINES_SCHEMA.findall(p.read_text(encoding="utf-8"))}
    bad = []
    for doc in DOCS:
        text = doc.read_text(encoding="utf-8")
        for path in set(SHIPPED_FILE.findall(text)):
            if "*" not in path and not (ROOT / path).exists():
                bad.append(f"{_rel(doc)}: {path} does not ship")
        for block in FENCE.findall(text):
            defined = set(DEFINES_SCHEMA.findall(block)) | set(DEFINES_SCHEMA.findall(text))
            for name in USES_SCHEMA.findall(block):
                if name not in shipped | defined:
                    bad.append(f"{_rel(doc)}: an example uses schema '{name}', which neither ships in schemas/ "
                               f"({', '.join(sorted(shipped))}) nor is defined in the doc")
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("heading, anchor", [("Restart without amnesia", "restart-without-amnesia"),
                                             ("The HTTP API: `promptcache serve`", "the-http-api-promptcache-serve"),
                                             ("Counting tokens: cached, recomputed, new",
                                              "counting-tokens-cached-recomputed-new")])
def test_slug_is_githubs(heading, anchor):
    assert slug(heading) == anchor
