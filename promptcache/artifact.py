"""Compiled schemas on disk: ``manifest.json`` + one states file (``store.codec`` format).

Layout of an artifact folder::

    manifest.json                 format version, schema (name, digest, PML text, src files),
                                  layout, dtype, KV shape, model and tokenizer fingerprints,
                                  the states file's name, per state its codec checksum and
                                  bytes, and ``manifest_sha256`` over all of the above
    modules-<digest>.safetensors  one tensor per stored span, "span_<index>": [L, 2, H, n, D];
                                  its metadata records each state's content key (computed in
                                  the namespace ``keys.PORTABLE``, so one artifact loads into any
                                  namespace), the model digest and the checksum (see codec)
    .lock                         the writers' lock (``fsutil.folder_lock``)

What a load proves (``compiled.load_compiled``): the manifest hash matches what the manifest
lists; model, tokenizer and schema match the engine; the layout matches the tokenizer; and for
every state the file's header names the key the engine computes, the dtype and shape the model
needs, this model, and the checksum the manifest lists (all from the header, no data read).
The data is verified against the checksum the first time each state is read. Anything else is
refused with ``ArtifactError`` (or ``StoreError`` at first read) naming the file and the part.

Writes: under the folder lock, the states file is written atomically (``fsutil``), then the
manifest (which commits the artifact), then states files no longer named are removed. Two
concurrent compiles into one folder run one after the other; **the last to take the lock wins**
(its manifest and states file remain; the other's states file is removed). A crash leaves the
old artifact or none. A loader reads the manifest and opens the states file under the same lock
and keeps the file mapped, so a later compile cannot pull the states from under it.
"""

from __future__ import annotations

import hashlib
import json
import tempfile
from contextlib import contextmanager
from pathlib import Path

import torch

from . import jsonsafe
from .errors import PromptCacheError
from .fsutil import atomic_write, folder_lock, remove_stale_temps
from .layout import SchemaLayout
from .pml.nodes import Module, Schema
from .pml.parser import parse_schema
from .pml.source import read_source
from .store.codec import CodecError, StateInfo, StatesFile, write_file

FORMAT_VERSION = 2
MANIFEST = "manifest.json"


class ArtifactError(PromptCacheError, RuntimeError):
    """A compiled artifact cannot be used; the message says which part is wrong."""

    exit_code = 1


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
                   layout: SchemaLayout, states: dict[int, tuple[str, torch.Tensor]], model_fp: dict,
                   model_digest: str, tokenizer_fp: str, kv_spec: dict, model_name: str | None = None) -> Path:
    """Write an artifact; ``states``: stored span index -> (portable content key, kv [L, 2, H, n, D]).
    ``model_name``: what ``--model`` loads the model compiled for (None: unknown), for advice only."""
    out = Path(out_dir)
    named = {f"span_{i}": kk for i, kk in sorted(states.items())}
    with folder_lock(out):
        remove_stale_temps(out)  # left by a killed writer: never part of an artifact
        digest = hashlib.sha256(json.dumps({n: k for n, (k, _) in named.items()}, sort_keys=True).encode()
                                + model_digest.encode()).hexdigest()
        states_file = f"modules-{digest[:16]}.safetensors"
        codec_sums = write_file(out / states_file, named, model_digest, {"schema": layout.name})
        sums = dict(sorted(codec_sums.items()))
        text, files, source = sources
        manifest = {
            "format_version": FORMAT_VERSION,
            "schema": {"name": layout.name, "digest": schema.digest, "source": source, "text": text,
                       "src_files": files},
            "layout": {"end": layout.end, "spans": layout_record(layout)},
            "dtype": kv_spec["dtype"],
            "kv_spec": kv_spec,
            "model": model_fp,
            "model_name": model_name,
            "model_digest": model_digest,
            "tokenizer": {"sha256": tokenizer_fp},
            "states": {"file": states_file, "sha256": sums,
                       "nbytes": {n: kv.numel() * kv.element_size() for n, (_, kv) in named.items()}},
        }
        manifest["manifest_sha256"] = manifest_hash(manifest)
        atomic_write(out / MANIFEST, json.dumps(manifest, indent=1))
        for old in out.glob("modules-*.safetensors"):
            if old.name != states_file:
                old.unlink(missing_ok=True)
    return out


def intact(manifest: dict) -> bool:
    """Whether the manifest's content matches its ``manifest_sha256``."""
    return manifest.get("manifest_sha256") == manifest_hash(manifest)


def manifest_hash(manifest: dict) -> str:
    """sha256 of the manifest's canonical JSON without its own ``manifest_sha256``."""
    body = {k: v for k, v in manifest.items() if k != "manifest_sha256"}
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


def read_manifest(path: str | Path) -> tuple[dict, StatesFile]:
    """The manifest of an artifact folder and its states file, opened (header checked: every
    listed state is present with the listed checksum). Under the folder lock. The manifest's own
    hash is reported by ``mismatches`` (with the model and tokenizer, so an edited manifest gets
    the same advice: recompile); callers must check ``mismatches`` before using the manifest."""
    folder = Path(path)
    mf = folder / MANIFEST
    if not mf.is_file():
        raise ArtifactError(f"{folder} is not a compiled schema: no {MANIFEST} (compile it with `promptcache compile`)")
    with folder_lock(folder):
        manifest = _parse_manifest(mf)
        states = folder / manifest["states"]["file"]
        try:
            opened = StatesFile(states)
            for name, sha in manifest["states"]["sha256"].items():
                opened.check(name, _expect_checksum(sha))
        except CodecError as e:
            raise ArtifactError(f"states file {states} is missing, truncated or corrupted, or not the one "
                                f"{mf} lists: {e}") from None
    return manifest, opened


def _expect_checksum(sha: str) -> StateInfo:
    return StateInfo(key=None, checksum=sha)  # the key is checked at registration


def _parse_manifest(mf: Path) -> dict:
    try:
        manifest = jsonsafe.loads(mf.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ArtifactError(f"{mf} is unreadable or corrupted: {e}") from None
    if not isinstance(manifest, dict):
        raise ArtifactError(f"{mf} is corrupted: not a JSON object")
    version = manifest.get("format_version")
    if version != FORMAT_VERSION:
        raise ArtifactError(f"{mf} has format version {version}; this promptcache reads version {FORMAT_VERSION} "
                            "(recompile it)")
    for field, typ in (("schema", dict), ("layout", dict), ("model", dict), ("model_digest", str),
                       ("tokenizer", dict), ("states", dict)):
        if not isinstance(manifest.get(field), typ):
            raise ArtifactError(f"{mf}: '{field}' is missing or not a {typ.__name__}: the manifest is incomplete "
                                "or corrupted")
    st = manifest["states"]
    if not (isinstance(st, dict) and isinstance(st.get("file"), str) and "/" not in st["file"]
            and isinstance(st.get("sha256"), dict) and isinstance(st.get("nbytes"), dict)):
        raise ArtifactError(f"{mf}: 'states' is malformed")
    return manifest


def foreign(manifest: dict, model_fp: dict, tokenizer_fp: str) -> list[str]:
    """How the model and tokenizer the artifact was compiled for differ from these (empty: the same).
    An artifact with such differences belongs to another model: it is never recompiled in place."""
    out = []
    built = manifest["model"]
    for key, what in (("architecture", "model architecture"), ("config_sha256", "model config"),
                      ("weights_sha256", "model weights"), ("dtype", "dtype")):
        if built.get(key) != model_fp.get(key):
            out.append(f"{what} differs (compiled: {_short(built.get(key))}, now: {_short(model_fp.get(key))})")
    if manifest["tokenizer"].get("sha256") != tokenizer_fp:
        out.append("tokenizer differs")
    return out


def compiled_for(manifest: dict) -> str:
    """The model an artifact was compiled for, as advice: "model 'smollm2' (float32)"."""
    name, dtype = manifest.get("model_name"), manifest["model"].get("dtype")
    if not isinstance(name, str) or not name:
        return f"another model (its name was not recorded; {dtype})"
    return f"model '{name}' ({dtype}; use it with --model {name} --dtype {dtype})"


def mismatches(manifest: dict, model_fp: dict, tokenizer_fp: str, schema_digest: str | None) -> list[str]:
    """Which parts of the artifact differ from this model, tokenizer and schema text."""
    out = foreign(manifest, model_fp, tokenizer_fp)
    if schema_digest is not None and manifest["schema"].get("digest") != schema_digest:
        out.append("schema text differs (the schema file or a src file changed since compiling)")
    if not intact(manifest):
        out.append("manifest.json was edited or corrupted (its content does not match manifest_sha256)")
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
