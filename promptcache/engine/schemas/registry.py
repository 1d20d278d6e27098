"""``SchemaRegistry``: encoded schemas by (namespace, name), the model and tokenizer fingerprints,
and the content keys they salt. No model forwards here (``encoder.py`` and ``runner.py`` do those)."""

from __future__ import annotations

import functools
import json
import logging
import threading
from dataclasses import dataclass

import torch

from ...keys import content_keys, model_fingerprint, tokenizer_fingerprint
from ...layout import SchemaLayout
from ...pml import PMLError

__all__ = ["EncodedSchema", "SchemaRegistry"]

log = logging.getLogger(__name__)


@dataclass
class EncodedSchema:
    """A schema whose modules are encoded; ``keys[i]`` is stored span i's content key."""

    layout: SchemaLayout
    keys: dict[int, str]
    positions: dict[int, torch.Tensor]  # span -> its position IDs [n] on the engine's device
    contexts: dict[int, tuple[int, ...]]  # span -> the spans before it in its encoding pass
    namespace: str
    bytes_per_token: int  # of the stored dtype (RunnerConfig.kv_dtype, else the model's)
    encode_seconds: float = 0.0

    @property
    def name(self) -> str:
        return self.layout.name

    @property
    def stored_tokens(self) -> int:
        return self.layout.stored_tokens  # every stored span has a key

    @property
    def stored_bytes(self) -> int:
        """Bytes of this schema's stored states in the stored dtype (``kv_dtype``)."""
        return self.stored_tokens * self.bytes_per_token

    def __repr__(self) -> str:  # counts, not the layout (whose repr runs to tens of thousands of characters)
        n_unions = len(self.layout.unions)
        return (f"EncodedSchema(name={self.name!r}, namespace={self.namespace!r}, spans={len(self.layout.spans)}, "
                f"modules={len(self.layout.modules)}, {n_unions} union{'' if n_unions == 1 else 's'}, "
                f"stored_tokens={self.stored_tokens}, stored_bytes={self.stored_bytes}, "
                f"encode_seconds={self.encode_seconds:.2f})")

    def default_order(self) -> list[int]:
        """Stored spans of the default encoding pass (every union as its scaffold) in schema order:
        the cached spans of a prompt that imports everything, as they are placed in its cache."""
        scaffold = {u.index: u.scaffold for u in self.layout.unions.values()}
        return [s.index for s in self.layout.spans
                if s.index in self.keys and all(scaffold[u] == m for u, m in s.choices)]


class SchemaRegistry:
    """Thread-safe map (namespace, schema name) -> EncodedSchema for one model and tokenizer."""

    def __init__(self, model, tokenizer, bytes_per_token: int, device: torch.device):
        self.model, self.tokenizer = model, tokenizer
        self.bytes_per_token, self.device = bytes_per_token, device
        self.lock = threading.Lock()  # guards ``entries`` only
        self.entries: dict[tuple[str, str], EncodedSchema] = {}

    @functools.cached_property
    def model_fingerprint(self) -> dict[str, str]:
        return model_fingerprint(self.model)

    @functools.cached_property
    def tokenizer_fingerprint(self) -> str:
        return tokenizer_fingerprint(self.tokenizer)

    @functools.cached_property
    def model_key(self) -> str:
        """Model and tokenizer fingerprints in one string: the part of every content key that names the model."""
        return json.dumps(self.model_fingerprint, sort_keys=True) + self.tokenizer_fingerprint

    def content_keys(self, layout: SchemaLayout, namespace: str) -> dict[int, str]:
        """Stored span index -> content key (namespace, model, tokens and positions of its context)."""
        return content_keys(layout, self.model_key, namespace)

    def register(self, layout: SchemaLayout, keys: dict[int, str], namespace: str, seconds: float) -> EncodedSchema:
        """Record a schema whose states are in the store under ``keys``; replaces one of the same name."""
        positions = {i: torch.arange(layout.spans[i].start, layout.spans[i].end, device=self.device) for i in keys}
        contexts = {t: p.spans[: p.spans.index(t)] for p in layout.passes() for t in p.targets}
        entry = EncodedSchema(layout, keys, positions, contexts, namespace, self.bytes_per_token, seconds)
        with self.lock:
            self.entries[(namespace, layout.name)] = entry
        log.info("schema '%s' (namespace '%s'): %d tokens stored (%.1f MiB) in %.2fs", entry.name, namespace,
                 entry.stored_tokens, entry.stored_bytes / 2**20, seconds)
        return entry

    def get(self, name: str, namespace: str) -> EncodedSchema:
        with self.lock:
            entry = self.entries.get((namespace, name))
            if entry is None:
                known = ", ".join(sorted(n for s, n in self.entries if s == namespace)) or "none"
                raise PMLError(f"unknown schema '{name}' (added in namespace '{namespace}': {known})")
        return entry

    def names(self, namespace: str) -> list[str]:
        with self.lock:
            return sorted(n for s, n in self.entries if s == namespace)
