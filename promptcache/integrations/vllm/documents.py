"""RAG documents on vLLM: a ``DocumentStore``'s persisted units supplied, each rotated to its place.

A store made with ``attach_separator=True`` stores each document *with* its separator as one
unit, encoded alone from position 0, and persists its prompt prefixes (BOS, template header,
system text) in its folder (``rag.folder``). Its prompt is then ``[prefix][unit]...[unit]`` and
one run of new text (the question and the template's tail), at consecutive positions: the shape
vLLM's connector API can be handed (a prefix of the prompt's tokens). The engine moves each unit
from position 0 to its start by rotating its keys (``models.relocate``); the connector does the
same (``states.rotated``), so vLLM's keys are the engine's at ``recompute=0`` with the
independent mode, whatever the documents' order.

* request side: ``document_supply(store, layout)``: the params (their salt) and T;
* connector side: ``DocumentStates(folders, model)`` reads the folders' indexes (re-read when a
  request names a document the connector has not seen and the index changed), checks a request
  (``check``: every unit's tokens are the prompt's, the model, the salt) and serves its states.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ... import jsonsafe
from ...keys import model_digest, token_digest
from ...layout import PromptLayout
from ...rag.documents import DocumentStoreError
from ...rag.folder import INDEX, check_index
from ...store.codec import CodecError, StateInfo, StatesFile
from .states import rotated
from .supply import VERSION, Supply, SupplyError, cache_salt

__all__ = ["DocumentStates", "Unit", "document_supply", "is_documents"]

log = logging.getLogger(__name__)


def document_supply(store, layout: PromptLayout) -> Supply:
    """What vLLM is given for ``layout``, a prompt of ``store`` (``DocumentStore.served_layout``:
    every cached span persisted): the prefix and every document's unit."""
    spans = layout.spans
    prefix = spans[0] if spans[0].name == "(prefix)" else None
    docs = [store.get(s.name.removeprefix("doc:")) for s in spans if s.name.startswith("doc:")]
    params = {"v": VERSION, "model": model_digest(store.pc.model_key),
              "prefix": token_digest(prefix.token_ids) if prefix else None,
              "prefix_tokens": len(prefix) if prefix else 0, "docs": [d.digest for d in docs]}
    tokens = sum(len(s) for s in spans if s.kind == "cached")
    if [s.kind for s in spans] != ["cached"] * (len(spans) - 1) + ["new"]:
        raise SupplyError("the documents' prompt is not its cached spans, then the question")
    return Supply(params, tokens, 0)


@dataclass(frozen=True)
class Unit:
    """One stored state of a request: ``file`` (n tokens) placed at position ``start``."""

    file: Path
    sha256: str
    model: str
    n: int
    start: int


@dataclass
class _Folder:
    path: Path
    mtime: float = -1.0
    model: str = ""
    suffix: tuple[int, ...] = ()
    docs: dict[str, dict] = field(default_factory=dict)  # document token digest -> index record
    prefixes: dict[str, dict] = field(default_factory=dict)  # prefix token digest -> index record


class DocumentStates:
    """The document folders the connector was given; ``model``: vLLM's model (layers, kv_heads,
    head_dim) that every state must fit. An unreadable folder is logged and skipped until its index
    changes."""

    def __init__(self, folders, model: dict | None = None):
        self.folders = [_Folder(Path(f)) for f in folders]
        self.model = model
        self.loaded: dict[tuple[Path, str], torch.Tensor] = {}  # worker: verified states, kept (documents are served whole)
        self.checked: set[tuple[Path, str]] = set()  # scheduler: states whose checksum it has verified (not kept)
        self.refresh()

    def refresh(self) -> None:
        """Re-read every folder whose index changed since it was read."""
        for f in self.folders:
            index = f.path / INDEX
            try:
                mtime = index.stat().st_mtime
                if mtime == f.mtime:
                    continue
                data = jsonsafe.loads(index.read_text(encoding="utf-8"))
                records = check_index(data, index)
            except (OSError, ValueError, DocumentStoreError) as e:
                log.error("promptcache: document folder %s is not used: %s", f.path, e)
                continue
            f.mtime, f.model, f.suffix = mtime, data.get("model_digest", ""), tuple(data.get("unit_suffix", ()))
            f.docs = {d["digest"]: d for d in records}
            f.prefixes = {p["digest"]: p for p in data.get("prefixes", ())}
            log.info("promptcache: document folder %s: %d documents, %d prefixes", f.path, len(f.docs), len(f.prefixes))

    def check(self, params: dict, prompt_token_ids, salt: str | None) -> tuple[list[Unit], int]:
        """(units in prompt order, supplied tokens) for a request's params; ``SupplyError`` names the
        first thing wrong (unknown document, another model, tokens that are not the units', the salt)."""
        docs, prefix, p = params.get("docs"), params.get("prefix"), params.get("prefix_tokens")
        if params.get("v") != VERSION:
            raise SupplyError(f"kv_transfer_params is not a version-{VERSION} object")
        if not isinstance(docs, list) or not docs or not all(isinstance(d, str) for d in docs) \
                or type(p) is not int or p < 0 or (prefix is None) != (p == 0):
            raise SupplyError("kv_transfer_params: 'docs' must be a non-empty list of document digests, 'prefix' a "
                              "digest with 'prefix_tokens' its length (or null and 0)")
        prompt, units, pos = list(prompt_token_ids or ()), [], 0
        if prefix is not None:
            f, rec = self._find("prefixes", prefix, params)
            if token_digest(prompt[:p]) != prefix or rec["n_tokens"] != p:
                raise SupplyError("the prompt's first tokens are not the stored prefix it names")
            units.append(self._unit(f, "prefixes", rec, p, 0))
            pos = p
        for digest in docs:
            f, rec = self._find("docs", digest, params)
            n = rec["n_tokens"]
            if token_digest(prompt[pos:pos + n]) != digest or tuple(prompt[pos + n:pos + n + len(f.suffix)]) != f.suffix:
                raise SupplyError(f"prompt tokens {pos}..{pos + n + len(f.suffix) - 1} are not document "
                                  f"{rec['id']!r} and its separator")
            units.append(self._unit(f, "docs", rec, n + len(f.suffix), pos))
            pos += n + len(f.suffix)
        if len(prompt) <= pos:
            raise SupplyError(f"the prompt has {len(prompt)} tokens: it must extend the {pos} supplied ones")
        if salt != cache_salt(params):
            raise SupplyError("the request's cache_salt is not the one its kv_transfer_params need "
                              "(use promptcache.integrations.vllm.to_vllm_request)")
        return units, pos

    def _find(self, kind: str, digest: str, params: dict) -> tuple[_Folder, dict]:
        for attempt in range(2):
            for f in self.folders:
                rec = getattr(f, kind).get(digest)
                if rec is not None and f.model == params.get("model"):
                    return f, rec
            if attempt == 0:
                self.refresh()  # a document added since the folders were read
        what = "document" if kind == "docs" else "prompt prefix"
        raise SupplyError(f"{what} {str(digest)[:12]} for model {str(params.get('model'))[:12]} is in none of the "
                          f"document folders the connector was given ({', '.join(str(f.path) for f in self.folders)})")

    @staticmethod
    def _unit(f: _Folder, kind: str, rec: dict, n: int, start: int) -> Unit:
        return Unit(f.path / kind / rec["file"], rec["sha256"], f.model, n, start)

    def verify(self, units: list[Unit]) -> None:
        """Read (and so checksum) every unit not read before, without keeping it (the scheduler's
        check); ``SupplyError`` names a bad one."""
        for u in units:
            if (u.file, u.sha256) not in self.loaded and (u.file, u.sha256) not in self.checked:
                self._read(u)
                self.checked.add((u.file, u.sha256))

    def kv(self, units: list[Unit], inv_freq: torch.Tensor) -> torch.Tensor:
        """kv [L, 2, H, T, D] of ``units``, each unit's keys rotated from 0 to its start."""
        for u in units:
            if (u.file, u.sha256) not in self.loaded:
                self.loaded[(u.file, u.sha256)] = self._read(u)
        return torch.cat([rotated(self.loaded[(u.file, u.sha256)], inv_freq, u.start) for u in units], dim=3)

    def _read(self, u: Unit) -> torch.Tensor:
        m = self.model
        shape = (m["layers"], 2, m["kv_heads"], u.n, m["head_dim"]) if m else None
        try:
            return StatesFile(u.file).read("kv", StateInfo(None, None, shape, u.model, u.sha256))
        except CodecError as e:
            raise SupplyError(f"a stored document state cannot be used: {e}") from None


def is_documents(params) -> bool:
    """Whether a request's ``kv_transfer_params["promptcache"]`` names documents (else a schema)."""
    return isinstance(params, dict) and "docs" in params

