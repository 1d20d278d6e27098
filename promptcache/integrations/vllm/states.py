"""Stored states as the vLLM connector reads them: compiled schema folders, checked, and rotated.

``CompiledStates`` opens each folder's manifest and states file (``artifact.read_manifest``: every
listed state present with its checksum; the manifest's own hash checked here), and serves a
request's spans as one ``kv [L, 2, H, n, D]`` (data verified against its checksum at first read).
``rotated`` moves the keys by one offset at the frequencies ``rope.rope_inv_freq`` gives
(``models.relocate.rotate_keys``, the mover promptcache itself uses, so both sides rotate alike).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ...artifact import ArtifactError, intact, read_manifest
from ...models.relocate import rotate_keys
from ...store.codec import CodecError, StateInfo, StatesFile
from .supply import SchemaSpans, SupplyError

__all__ = ["CompiledStates", "rotated"]

log = logging.getLogger(__name__)


@dataclass
class _Compiled:
    folder: Path
    spans: SchemaSpans
    kv_spec: dict  # layers, kv_heads, head_dim, dtype
    sums: dict[str, str]  # "span_<i>" -> codec checksum
    model_type: str  # the compiled model's config.model_type
    opened: StatesFile
    loaded: dict[int, torch.Tensor] = field(default_factory=dict)  # span index -> its verified state (worker)
    checked: set[int] = field(default_factory=set)  # spans whose checksum the scheduler has verified


class CompiledStates:
    """The compiled schemas of ``folders``, by (name, digest). A folder that cannot be used is
    logged and left out (its schemas' requests are then computed in full); ``model`` (model_type,
    layers, kv_heads, head_dim of the model vLLM serves) leaves out artifacts of another model."""

    def __init__(self, folders, model: dict | None = None):
        self.schemas: dict[tuple[str, str], _Compiled] = {}
        for folder in folders:
            try:
                c = _open(Path(folder))
            except ArtifactError as e:
                log.error("promptcache: compiled schema %s is not used: %s", folder, e)
                continue
            shape = {"model_type": c.model_type, **{k: c.kv_spec.get(k) for k in ("layers", "kv_heads", "head_dim")}}
            if model is not None and shape != model:
                log.error("promptcache: compiled schema %s is not used: its states are %s, vLLM's model has %s",
                          folder, shape, model)
                continue
            self.schemas[(c.spans.name, c.spans.digest)] = c
            log.info("promptcache: schema '%s' (%s) from %s: %d stored spans", c.spans.name, c.spans.digest[:12],
                     folder, len(c.spans.token_ids))

    def schema(self, name, digest) -> SchemaSpans:
        c = self.schemas.get((name, digest))
        if c is None:
            known = ", ".join(f"{n} ({d[:12]})" for n, d in self.schemas) or "none"
            raise SupplyError(f"schema '{name}' ({str(digest)[:12]}) is not among the compiled folders "
                              f"the connector was given (known: {known})")
        return c.spans

    def kv(self, name, digest, spans) -> torch.Tensor:
        """kv [L, 2, H, n, D] of ``spans`` in order (n: their tokens); CodecError if one fails its checksum."""
        return torch.cat([self._span(self.schemas[(name, digest)], i) for i in spans], dim=3)

    def verify(self, name, digest, spans) -> None:
        """Read (and so checksum) every state of ``spans`` not read before, without keeping it (the
        scheduler's check); SupplyError naming a damaged one."""
        c = self.schemas[(name, digest)]
        try:
            for i in spans:
                if i not in c.loaded and i not in c.checked:
                    self._read(c, i)
                    c.checked.add(i)
        except CodecError as e:
            raise SupplyError(f"a stored state of schema '{name}' cannot be used: {e}") from None

    def _span(self, c: _Compiled, i: int) -> torch.Tensor:
        """Span i's state [L, 2, H, n, D], read and verified once, then kept (a compiled schema is
        served whole, so its states stay in memory as they would in promptcache's host tier)."""
        kv = c.loaded.get(i)
        if kv is None:
            kv = c.loaded[i] = self._read(c, i)
        return kv

    @staticmethod
    def _read(c: _Compiled, i: int) -> torch.Tensor:
        spec = c.kv_spec
        shape = (spec["layers"], 2, spec["kv_heads"], len(c.spans.token_ids[i]), spec["head_dim"])
        return c.opened.read(f"span_{i}", StateInfo(None, spec["dtype"], shape, c.spans.model, c.sums[f"span_{i}"]))


def _open(folder: Path) -> _Compiled:
    manifest, opened = read_manifest(folder)
    if not intact(manifest):
        raise ArtifactError(f"{folder}: manifest.json does not match its manifest_sha256 (edited or damaged)")
    spans = [s for s in manifest["layout"]["spans"] if s["stored"]]
    record = SchemaSpans(name=manifest["schema"]["name"], digest=manifest["schema"]["digest"],
                         model=manifest["model_digest"],
                         token_ids={s["index"]: tuple(s["token_ids"]) for s in spans},
                         starts={s["index"]: s["start"] for s in spans})
    return _Compiled(folder, record, manifest["kv_spec"], manifest["states"]["sha256"],
                     manifest["model"].get("model_type"), opened)


def rotated(kv: torch.Tensor, inv_freq: torch.Tensor, offset: int) -> torch.Tensor:
    """kv [L, 2, H, n, D] with its keys moved by ``offset`` positions (values untouched)."""
    return kv if offset == 0 else rotate_keys(kv, inv_freq, offset)
