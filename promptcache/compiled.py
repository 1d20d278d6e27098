"""Compile a schema to an artifact and load it back into an engine (see ``artifact.py``)."""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING

from .layout import layout_schema
from .pml import parse_schema
from .artifact import (ArtifactError, layout_record, materialize_schema, materialized, mismatches,
                             read_manifest, schema_sources, write_artifact)
from .keys import content_keys

if TYPE_CHECKING:
    from .engine import EncodedSchema, PromptCache

log = logging.getLogger(__name__)


def compile_schema(pc: "PromptCache", schema, out_dir, progress=None, namespace=None, source_name=None) -> Path:
    text, files, source = schema_sources(schema)
    entry = pc.add_schema(schema, progress, namespace)
    states = {i: pc.store.get(k)[0] for i, k in entry.keys.items()}
    spec = {"layers": pc.spec.layers, "kv_heads": pc.spec.kv_heads, "head_dim": pc.spec.head_dim,
            "dtype": str(pc.spec.dtype).removeprefix("torch.")}
    return write_artifact(out_dir, sources=(text, files, source_name or source), schema=entry.layout.schema,
                          layout=entry.layout, states=states, model_fp=pc.model_fingerprint,
                          tokenizer_fp=pc.tokenizer_fingerprint, kv_spec=spec)


def load_compiled(pc: "PromptCache", path, schema=None, recompile=False, namespace=None,
                  verify=False) -> "EncodedSchema":
    t0 = time.perf_counter()
    try:
        manifest = read_manifest(path)
        digest = parse_schema(schema).digest if schema is not None else None
        problems = mismatches(manifest, pc.model_fingerprint, pc.tokenizer_fingerprint, digest)
    except ArtifactError:
        if not (recompile and schema is not None):
            raise
        manifest, problems = None, ["no usable artifact"]
    if problems:
        if not recompile:
            raise ArtifactError(f"compiled schema {path} does not match: {'; '.join(problems)}. "
                                "Recompile it (`promptcache compile`, or recompile=True / --recompile).")
        log.warning("recompiling %s: %s", path, "; ".join(problems))
        if schema is not None:
            compile_schema(pc, schema, path, namespace=namespace)
        else:  # the schema text embedded in the manifest
            with materialized(manifest) as source:
                compile_schema(pc, source, path, namespace=namespace, source_name=manifest["schema"]["source"])
        return load_compiled(pc, path, schema, namespace=namespace, verify=verify)
    layout = layout_schema(materialize_schema(manifest), pc.tok)
    if layout_record(layout) != manifest["layout"]["spans"]:
        raise ArtifactError(f"compiled schema {path}: the tokenizer lays the schema out differently now")
    ns = namespace or pc.config.namespace
    keys = content_keys(layout, pc.model_key, ns)
    states = manifest["states"]
    entries = {k: (f"span_{i}", states["sha256"][f"span_{i}"], states["nbytes"][f"span_{i}"]) for i, k in keys.items()}
    pc.store.register_file(Path(path) / states["file"], entries)
    if verify:
        for k in keys.values():
            pc.store.get(k)
    return pc.register_schema(layout, keys, ns, time.perf_counter() - t0)
