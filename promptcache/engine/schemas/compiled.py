"""Compile a schema to an artifact and load it back into an engine (format: ``artifact.py``).

Loading registers the artifact's states with the store's disk tier; each registration names
exactly what the engine needs (``StateInfo``: the portable content key, dtype, shape
[L, 2, H, n, D] from the engine's KV spec, the model digest and the manifest's checksum), so a
states file that is not that (another model's, another schema's, a flipped header byte) is
refused at load. Registering replaces any stale entry for the same keys: after a corrupted
artifact was refused (and its states dropped from every local tier), loading a good one works.
Compiling also publishes the states to the store's shared tiers (``StoreConfig.remote``):
under their namespace keys, what replicas running ``add_schema`` look up.

Dtype: an artifact records the dtype its states are stored in (the engine's ``kv_dtype``, else
the model's). Loading into an engine that stores another dtype is refused unless
``convert=True``: then every state is read from the file (checked against the manifest in the
file's dtype), converted to the engine's stored dtype and put in the store's memory now; the
artifact stays as it is on disk.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from ...artifact import (ArtifactError, compiled_for, foreign, intact, layout_record, materialize_schema, materialized, mismatches, read_manifest, schema_sources, write_artifact)
from ...keys import PORTABLE, content_keys, model_digest
from ...layout import SchemaLayout, layout_schema
from ...pml import PMLError, parse_schema
from ...store.codec import CodecError, StateInfo, StatesFile

# ``core`` below is the engine's core (``engine/core.EngineCore``), which calls this module with
# itself; it is not imported, even for type checking, so the two modules never import each other.

log = logging.getLogger(__name__)

_FLOAT_DTYPES = ("float32", "bfloat16", "float16")  # stored dtypes convert=True converts between


def kv_spec_record(core: "EngineCore") -> dict:
    """The stored states' shape and dtype (the engine's stored dtype, which kv_dtype sets)."""
    spec = core.runner.stored_spec
    return {"layers": spec.layers, "kv_heads": spec.kv_heads, "head_dim": spec.head_dim,
            "dtype": str(spec.dtype).removeprefix("torch.")}


def compile_schema(core: "EngineCore", schema, out_dir, progress=None, namespace=None, source_name=None) -> Path:
    text, files, source = schema_sources(schema)
    entry = core.add_schema(schema, progress, namespace)
    portable = content_keys(entry.layout, core.model_key, PORTABLE)
    states = {i: (portable[i], core.store.get(k)[0]) for i, k in entry.keys.items()}
    for i, k in entry.keys.items():  # with a shared tier: every replica can use them (whatever its policy)
        core.store.publish(k, states[i][1])
    return write_artifact(out_dir, sources=(text, files, source_name or source), schema=entry.layout.schema,
                          layout=entry.layout, states=states, model_fp=core.model_fingerprint,
                          model_digest=model_digest(core.model_key), tokenizer_fp=core.tokenizer_fingerprint,
                          kv_spec=kv_spec_record(core), model_name=getattr(core.model, "name_or_path", None) or None)


def load_compiled(core: "EngineCore", path, schema=None, recompile=False, namespace=None,
                  verify=False, convert=False) -> "EncodedSchema":
    t0 = time.perf_counter()
    try:
        manifest, opened = read_manifest(path)
        digest = parse_schema(schema).digest if schema is not None else None
        problems = mismatches(manifest, core.model_fingerprint, core.tokenizer_fingerprint, digest)
        stored, now = manifest.get("kv_spec"), kv_spec_record(core)
        file_dtype = stored.get("dtype") if isinstance(stored, dict) else None
        only_dtype = isinstance(stored, dict) and stored != now and {**stored, "dtype": now["dtype"]} == now
        if only_dtype and file_dtype in _FLOAT_DTYPES:
            if not convert:
                problems.append(f"states are stored in {file_dtype}, this engine stores {now['dtype']} "
                                "(kv_dtype): load with convert=True to convert them, or recompile")
        elif stored != now:
            problems.append(f"KV shape or dtype differs (compiled: {manifest.get('kv_spec')}, "
                            f"now: {kv_spec_record(core)})")
    except ArtifactError:
        if not (recompile and schema is not None):
            raise
        manifest, problems = None, ["no usable artifact"]
    if manifest is not None and foreign(manifest, core.model_fingerprint, core.tokenizer_fingerprint):
        raise ArtifactError(_foreign_advice(path, manifest, problems, recompile))
    if problems:
        if not recompile:
            raise ArtifactError(f"compiled schema {path} does not match: {'; '.join(problems)}. "
                                "Recompile it (`promptcache compile`, or recompile=True / --recompile).")
        if schema is None and not _embedded_schema_intact(manifest):
            raise ArtifactError(f"compiled schema {path} cannot be recompiled from its own manifest: "
                                f"{'; '.join(problems)}; its embedded schema text does not match its digest. "
                                "Pass the schema source to recompile it.")
        log.warning("recompiling %s: %s", path, "; ".join(problems))
        if schema is not None:
            compile_schema(core, schema, path, namespace=namespace)
        else:  # the schema text embedded in the manifest
            with materialized(manifest) as source:
                compile_schema(core, source, path, namespace=namespace, source_name=manifest["schema"]["source"])
        return load_compiled(core, path, schema, namespace=namespace, verify=verify)
    layout = layout_schema(materialize_schema(manifest), core.tok, max_positions=core.adapter.max_positions)
    if layout_record(layout) != manifest["layout"]["spans"]:
        raise ArtifactError(f"compiled schema {path}: the tokenizer lays the schema out differently now")
    ns = core.config.namespace_for(namespace)
    keys = content_keys(layout, core.model_key, ns)
    entries = _entries(core, layout, keys, manifest, opened, file_dtype)
    if file_dtype != kv_spec_record(core)["dtype"]:  # convert=True (refused above otherwise)
        _convert_into_store(core, entries, opened)
        log.info("compiled schema %s: converted %d states from %s to %s", path, len(entries), file_dtype,
                 kv_spec_record(core)["dtype"])
        return core.register_schema(layout, keys, ns, time.perf_counter() - t0)
    core.store.register_file(opened.path, entries, opened)
    if verify:
        for k in keys.values():
            core.store.get(k)
    return core.register_schema(layout, keys, ns, time.perf_counter() - t0, place=verify)


def _foreign_advice(path, manifest: dict, problems: list[str], recompile: bool) -> str:
    """Why an artifact of another model or tokenizer is refused, and what to do: never recompile
    it in place (that would destroy the other model's states)."""
    why = ("; it is not recompiled in place, which would destroy that model's states" if recompile else "")
    return (f"compiled schema {path} was compiled for {compiled_for(manifest)}, not for this model: "
            f"{'; '.join(problems)}{why}. Load it with that model, or compile the schema for this model "
            "into another folder (`promptcache compile SCHEMA --model M --out NEW_DIR`).")


def _embedded_schema_intact(manifest: dict) -> bool:
    """Whether the manifest's PML text and src files still give the digest it records (an edited
    or corrupted manifest may be recompiled from its own text only when they do)."""
    if intact(manifest):
        return True
    try:
        return materialize_schema(manifest).digest == manifest["schema"].get("digest")
    except (PMLError, ArtifactError, KeyError, TypeError, AttributeError, OSError):  # a damaged text
        return False


def _convert_into_store(core: "EngineCore", entries: dict[str, tuple[str, StateInfo, int]],
                        opened: StatesFile) -> None:
    """Read every state (checksummed), convert it to the engine's stored dtype, put it in the store."""
    dtype = core.runner.stored_spec.dtype
    for key, (name, expect, _) in entries.items():
        try:
            kv = opened.read(name, expect)
        except CodecError as e:
            raise ArtifactError(f"compiled schema {opened.path.parent}: {e}") from None
        core.store.put(key, kv.to(dtype))


def _entries(core: "EngineCore", layout: SchemaLayout, keys: dict[int, str], manifest: dict,
             opened: StatesFile, dtype: str) -> dict[str, tuple[str, StateInfo, int]]:
    """Store key -> (tensor name, what it must be, bytes); refuses a state that is not that.
    ``dtype``: the dtype the artifact records for its states."""
    portable = content_keys(layout, core.model_key, PORTABLE)
    sums, spec, digest = manifest["states"]["sha256"], core.spec, model_digest(core.model_key)
    entries = {}
    for i, key in keys.items():
        name = f"span_{i}"
        if name not in sums:
            raise ArtifactError(f"{manifest['states']['file']}: the manifest lists no state '{name}'")
        shape = (spec.layers, 2, spec.kv_heads, len(layout.spans[i].token_ids), spec.head_dim)
        expect = StateInfo(portable[i], dtype, shape, digest, sums[name])
        try:
            opened.check(name, expect)
        except CodecError as e:
            raise ArtifactError(f"compiled schema {opened.path.parent}: {e}") from None
        entries[key] = (name, expect, opened.nbytes(name))
    return entries
