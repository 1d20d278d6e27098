"""Compiled schemas on disk: ``manifest.json`` + one safetensors file of module states.

Layout of an artifact folder::

    manifest.json                 format version, schema (name, digest, PML text, src files),
                                  layout, dtype, KV shape, model and tokenizer fingerprints,
                                  the states file's name and a sha256 per state
    modules-<digest>.safetensors  one tensor per stored span, "span_<index>": [L, 2, H, n, D]

Writes are atomic: the states file is written under a temporary name, fsynced and renamed; then
the manifest is replaced the same way, which commits the artifact. A crash leaves the old
artifact (its states file is removed only after the new manifest is in place) or none.
"""

from __future__ import annotations

import json
import os
import tempfile
from contextlib import contextmanager
from pathlib import Path

import torch
from safetensors import safe_open

from .layout import SchemaLayout
from .pml.nodes import Module, Schema
from .pml.parser import parse_schema
from .pml.source import read_source
from .store.disk import atomic_save, tensor_sha256

FORMAT_VERSION = 1
MANIFEST = "manifest.json"


class ArtifactError(RuntimeError):
    """A compiled artifact cannot be used; the message says which part is wrong."""


def schema_sources(text_or_path) -> tuple[str, dict[str, str], str]:
    """(PML text, {src path: file text}, source name) of a schema, for embedding in a manifest."""
    text, source, base = read_source(text_or_path, "schema")
    schema = parse_schema(text_or_path)
    files = {}
    for m in _modules(schema.children):
        if m.src is not None:
            files[m.src] = ((base or Path.cwd()) / m.src).read_text(encoding="utf-8")
    return text, files, source


def _modules(children):
    for c in children:
        if isinstance(c, Module):
            yield c
            yield from _modules(c.children)
        elif hasattr(c, "members"):
            for m in c.members:
                yield m
                yield from _modules(m.children)
        elif hasattr(c, "children"):
            yield from _modules(c.children)


def layout_record(layout: SchemaLayout) -> list[dict]:
    return [{"index": s.index, "kind": s.kind, "module": "/".join(s.module), "start": s.start,
             "token_ids": list(s.token_ids), "stored": s.stored} for s in layout.spans]


def write_artifact(out_dir: str | Path, *, sources: tuple[str, dict[str, str], str], schema: Schema,
                   layout: SchemaLayout, states: dict[int, torch.Tensor], model_fp: dict, tokenizer_fp: str,
                   kv_spec: dict) -> Path:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for stale in out.glob("*.tmp"):  # left by a crash mid-write: never part of an artifact
        stale.unlink(missing_ok=True)
    tensors = {f"span_{i}": t for i, t in sorted(states.items())}
    sums = {name: tensor_sha256(t) for name, t in tensors.items()}
    digest = tensor_sha256(torch.tensor(list(json.dumps(sums, sort_keys=True).encode()), dtype=torch.uint8))
    states_file = f"modules-{digest[:16]}.safetensors"
    atomic_save(tensors, out / states_file, metadata={"format": "promptcache", "schema": layout.name})
    text, files, source = sources
    manifest = {
        "format_version": FORMAT_VERSION,
        "schema": {"name": layout.name, "digest": schema.digest, "source": source, "text": text, "src_files": files},
        "layout": {"end": layout.end, "spans": layout_record(layout)},
        "dtype": kv_spec["dtype"],
        "kv_spec": kv_spec,
        "model": model_fp,
        "tokenizer": {"sha256": tokenizer_fp},
        "states": {"file": states_file, "sha256": sums,
                   "nbytes": {n: t.numel() * t.element_size() for n, t in tensors.items()}},
    }
    atomic_write_text(out / MANIFEST, json.dumps(manifest, indent=1))
    for old in out.glob("modules-*.safetensors"):
        if old.name != states_file:
            old.unlink(missing_ok=True)
    return out


def atomic_write_text(path: Path, text: str) -> None:
    fd, tmp = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def read_manifest(path: str | Path) -> dict:
    folder = Path(path)
    mf = folder / MANIFEST
    if not mf.is_file():
        raise ArtifactError(f"{folder} is not a compiled schema: no {MANIFEST} (compile it with `promptcache compile`)")
    try:
        manifest = json.loads(mf.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ArtifactError(f"{mf} is unreadable or corrupted: {e}") from None
    version = manifest.get("format_version")
    if version != FORMAT_VERSION:
        raise ArtifactError(f"{mf} has format version {version}; this promptcache reads version {FORMAT_VERSION}")
    for field in ("schema", "layout", "model", "tokenizer", "states"):
        if field not in manifest:
            raise ArtifactError(f"{mf} lacks '{field}': the manifest is incomplete")
    states = folder / manifest["states"]["file"]
    try:
        with safe_open(str(states), framework="pt") as f:
            names = set(f.keys())
    except Exception as e:
        raise ArtifactError(f"states file {states} is missing, truncated or corrupted: {e}") from None
    missing = set(manifest["states"]["sha256"]) - names
    if missing:
        raise ArtifactError(f"states file {states} lacks {len(missing)} states listed in the manifest")
    return manifest


def mismatches(manifest: dict, model_fp: dict, tokenizer_fp: str, schema_digest: str | None) -> list[str]:
    """Which parts of the artifact differ from this model, tokenizer and schema text."""
    out = []
    built = manifest["model"]
    for key, what in (("architecture", "model architecture"), ("config_sha256", "model config"),
                      ("weights_sha256", "model weights"), ("dtype", "dtype")):
        if built.get(key) != model_fp.get(key):
            out.append(f"{what} differs (compiled: {_short(built.get(key))}, now: {_short(model_fp.get(key))})")
    if manifest["tokenizer"].get("sha256") != tokenizer_fp:
        out.append("tokenizer differs")
    if schema_digest is not None and manifest["schema"]["digest"] != schema_digest:
        out.append("schema text differs (the schema file or a src file changed since compiling)")
    return out


def _short(v) -> str:
    return str(v)[:12] if v is not None else "none"


@contextmanager
def materialized(manifest: dict):
    """The schema embedded in a manifest, written to a temporary folder: yields its path."""
    sch = manifest["schema"]
    with tempfile.TemporaryDirectory(prefix="promptcache-schema-") as tmp:
        root = Path(tmp)
        for rel, text in sch["src_files"].items():
            target = (root / rel).resolve()
            if root.resolve() not in target.parents:
                raise ArtifactError(f"manifest src path '{rel}' points outside the schema folder")
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(text, encoding="utf-8")
        (root / "schema.pml").write_text(sch["text"], encoding="utf-8")
        yield root / "schema.pml"


def materialize_schema(manifest: dict) -> Schema:
    """Rebuild the schema tree from the PML text and src files embedded in the manifest."""
    with materialized(manifest) as path:
        schema = parse_schema(path)
    schema.source = manifest["schema"]["source"]
    return schema
