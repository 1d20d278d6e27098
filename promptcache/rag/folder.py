"""A persisted ``DocumentStore``'s folder: its index and one states file a document.

Layout (independent states, written atomically with ``fsutil``)::

    index.json                  {"format_version": 2, "model": {fingerprint}, "model_digest": str,
                                 "tokenizer": str, "encode_prefix": [token ids each document was
                                 encoded after; absent or []: alone], "documents": [{"id": str, "text": str,
                                 "metadata": {}, "n_tokens": int, "digest": sha256 of the token
                                 ids, "file": str, "sha256": codec checksum}, ...],
                                 "unit_suffix": [token ids stored after each document: its
                                 separator, or none], "prefixes": [{"digest", "n_tokens", "file",
                                 "sha256"}, ...]}
    docs/<digest[:32]>.safetensors   one state "kv" [L, 2, H, n, D] in the codec format
                                 (portable key, model digest, checksum in its header): the
                                 document's unit (its tokens, then unit_suffix) encoded after
                                 encode_prefix (alone where it is empty)
    prefixes/<digest[:32]>.safetensors   a prompt prefix (BOS, template header, system text)
                                 encoded alone, written by stores whose units carry their separator

``unit_suffix`` and ``prefixes`` may be absent (folders written before them: no suffix, none).
``encode_prefix`` is the folder's encoding (``recorded_prefix``): a store opened with ``prefixed``
and ``system`` left out takes it; a store that asks for another finds it among ``read``'s problems.

Reading checks every field of the index (a wrong type, a null or a missing field is a
``DocumentStoreError`` naming the file, the document and the field), then each document against
the tokenizer and its file's name; what a states file must hold (key, dtype, shape, model,
checksum) is handed to the store's disk tier, which verifies the data on first read. The folder
knows the engine only through what it reads here: ``model_key``, the fingerprints, ``tok`` and
the stored KV spec.
"""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

import torch

from .. import jsonsafe
from ..fsutil import atomic_write
from ..keys import PORTABLE, alone_key, model_digest, token_digest
from ..store.codec import CodecError, StateInfo, StatesFile, write_file
from .documents import Document, DocumentStoreError

__all__ = ["FORMAT_VERSION", "INDEX", "DocumentFolder"]

FORMAT_VERSION = 2
INDEX = "index.json"
_FIELDS = {"id": str, "text": str, "metadata": dict, "n_tokens": int, "digest": str, "file": str, "sha256": str}
_PREFIX_FIELDS = {"digest": str, "n_tokens": int, "file": str, "sha256": str}


class DocumentFolder:
    """``path``: the folder; ``pc``: the engine whose states it holds; ``encode_prefix``: the tokens
    each document is encoded after (``DocumentStore.encode_prefix``). ``sums``: document digest ->
    checksum of its states file, for every document written or opened."""

    def __init__(self, path: str | Path, pc, suffix: tuple[int, ...] = (), encode_prefix: tuple[int, ...] = ()):
        self.path, self.pc, self.suffix, self.encode_prefix = Path(path), pc, tuple(suffix), tuple(encode_prefix)
        self.sums: dict[str, str] = {}
        self.prefixes: dict[str, dict] = {}  # prefix token digest -> its index record
        self._parsed: dict | None = None  # the index as ``recorded_prefix`` read it, for ``read`` to check

    @property
    def index(self) -> Path:
        return self.path / INDEX

    def exists(self) -> bool:
        return self.index.is_file()

    def file(self, doc: Document) -> Path:
        return self.path / "docs" / f"{doc.digest[:32]}.safetensors"

    def has_states(self, doc: Document) -> bool:
        return doc.digest in self.sums

    def write_states(self, doc: Document, kv: torch.Tensor) -> None:
        """Write (or rewrite) a document's states file: one state "kv" (its unit) with its portable key."""
        sums = write_file(self.file(doc), {"kv": (self.portable_key(doc.token_ids + self.suffix), kv)},
                          model_digest(self.pc.model_key))
        self.sums[doc.digest] = sums["kv"]

    def has_prefix(self, token_ids) -> bool:
        return token_digest(token_ids) in self.prefixes

    def write_prefix(self, token_ids, kv: torch.Tensor) -> None:
        """Write a prompt prefix's states (encoded alone); listed in the index at the next ``save``."""
        digest = token_digest(token_ids)
        f = self.path / "prefixes" / f"{digest[:32]}.safetensors"
        sums = write_file(f, {"kv": (self.portable_key(token_ids), kv)}, model_digest(self.pc.model_key))
        self.prefixes[digest] = {"digest": digest, "n_tokens": len(token_ids), "file": f.name, "sha256": sums["kv"]}

    def portable_key(self, token_ids) -> str:
        return alone_key(token_ids, self.pc.model_key, PORTABLE)

    def save(self, docs) -> None:
        """Write index.json for ``docs`` (every one's states file written before)."""
        records = [{**{k: v for k, v in asdict(d).items() if k != "token_ids"},
                    "file": self.file(d).name, "sha256": self.sums[d.digest]} for d in docs]
        index = {"format_version": FORMAT_VERSION, "model": self.pc.model_fingerprint,
                 "model_digest": model_digest(self.pc.model_key), "tokenizer": self.pc.tokenizer_fingerprint,
                 "encode_prefix": list(self.encode_prefix), "documents": records, "unit_suffix": list(self.suffix),
                 "prefixes": list(self.prefixes.values())}
        atomic_write(self.index, json.dumps(index, indent=1))

    def _load(self) -> tuple[dict, list[dict]]:
        """(the parsed index, its field-checked document records); read once at opening."""
        if self._parsed is None:
            try:
                self._parsed = jsonsafe.loads(self.index.read_text(encoding="utf-8"))
            except (OSError, ValueError) as e:
                raise DocumentStoreError(f"{self.index} is unreadable or corrupted: {e}") from None
        return self._parsed, check_index(self._parsed, self.index)

    def recorded_prefix(self) -> tuple[int, ...] | None:
        """The tokens the folder's documents were encoded after (its ``encode_prefix``; () alone, as
        in a folder written before the field), or None where its tokenizer is not this engine's (the
        tokens mean nothing here)."""
        index, _ = self._load()
        if index["tokenizer"] != self.pc.tokenizer_fingerprint:
            return None
        return tuple(index.get("encode_prefix", ()))

    def describe(self, prefix) -> str:
        """An encoding in words: "alone from position 0" or "after a 12-token prefix ('...')"."""
        if not prefix:
            return "alone from position 0"
        decode = getattr(getattr(self.pc, "tokenizer", None), "decode", None)  # the model's tokenizer, where it has one
        text = decode(list(prefix)) if decode is not None else ""
        return f"after a {len(prefix)}-token prefix" + (f" ({text!r:.80})" if text else "")

    def read(self) -> tuple[list[dict], list[str]]:
        """(the index's document records, field-checked; what differs from this engine's model,
        tokenizer, document encoding (``encode_prefix``) and unit suffix, empty when nothing does)."""
        index, docs = self._load()
        self._parsed = None
        problems = [f"model {k.removesuffix('_sha256')} differs"
                    for k in ("architecture", "config_sha256", "weights_sha256", "dtype")
                    if index["model"].get(k) != self.pc.model_fingerprint.get(k)]
        if index["tokenizer"] != self.pc.tokenizer_fingerprint:
            problems.append("tokenizer differs")
        held = tuple(index.get("encode_prefix", ()))  # a folder without the field: encoded alone
        if held != self.encode_prefix and "tokenizer differs" not in problems:
            problems.append(f"its documents were encoded {self.describe(held)}, this store asks for them encoded "
                            f"{self.describe(self.encode_prefix)} (DocumentStore(prefixed=..., system=...); both left "
                            "out open a folder with its own encoding)")
        if tuple(index.get("unit_suffix", ())) != self.suffix:
            problems.append("documents were stored " + ("without" if self.suffix else "with") + " their separator "
                            "(attach_separator)")
        elif not problems:
            self.prefixes = {p["digest"]: p for p in index.get("prefixes", ())}
        return docs, problems

    def opened(self, records: list[dict]) -> list[tuple[Document, Path, StateInfo]]:
        """Each record as (document, states file, what the file must hold); everything is checked
        before anything is returned, so on an error nothing gets registered. A file that is
        missing is returned all the same (and not counted as written): its document's text is
        known, so the store rebuilds it."""
        out = []
        for d in records:
            ids = tuple(self.pc.tok.encode(d["text"]))
            doc = Document(d["id"], d["text"], d["metadata"], len(ids), d["digest"], ids)
            if token_digest(ids) != doc.digest or d["n_tokens"] != len(ids):
                raise DocumentStoreError(f"{self.index}: document '{doc.id}' tokenizes differently than when it was "
                                         "stored")
            f = self.file(doc)
            if d["file"] != f.name:
                raise DocumentStoreError(f"{self.index}: document '{doc.id}': states file {d['file']!r} is misnamed "
                                         f"(field 'file', expected {f.name})")
            out.append((doc, f, self.expectation(doc, d["sha256"])))
        for doc, f, expect in out:
            if f.is_file():  # a missing file is the caller's to rebuild from the text
                self.sums[doc.digest] = expect.checksum
        return out

    def expectation(self, doc: Document, checksum: str | None = None) -> StateInfo:
        """What ``doc``'s states file must hold (``checksum``: the index's; None: the one written or opened)."""
        spec = self.pc.runner.stored_spec  # states are persisted in the stored dtype
        shape = (spec.layers, 2, spec.kv_heads, len(doc.token_ids) + len(self.suffix), spec.head_dim)
        return StateInfo(self.portable_key(doc.token_ids + self.suffix), str(spec.dtype).removeprefix("torch."),
                         shape, model_digest(self.pc.model_key), checksum or self.sums.get(doc.digest))

    def damage(self, doc: Document) -> str | None:
        """What is wrong with ``doc``'s states file (missing, unreadable, failing its checks or its
        checksum), or None when it is intact. Reads and verifies the whole file."""
        try:
            StatesFile(self.file(doc)).read("kv", self.expectation(doc))
        except (CodecError, OSError) as e:
            return str(e)
        return None


def check_index(index, where: Path) -> list[dict]:
    """The documents of a parsed index.json, every field type-checked (else DocumentStoreError)."""
    def bad(field: str, what: str):
        return DocumentStoreError(f"{where}: field '{field}' {what}")

    if not isinstance(index, dict):
        raise bad("(top level)", f"must be an object, got {type(index).__name__}")
    if index.get("format_version") != FORMAT_VERSION:
        raise bad("format_version", f"is {index.get('format_version')!r}; this promptcache reads {FORMAT_VERSION}")
    if not isinstance(index.get("model"), dict):
        raise bad("model", "must be an object (the model fingerprint)")
    if not isinstance(index.get("tokenizer"), str):
        raise bad("tokenizer", "must be a string (the tokenizer fingerprint)")
    prefix = index.get("encode_prefix", [])
    if not isinstance(prefix, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in prefix):
        raise bad("encode_prefix", "must be a list of token ids (what each document was encoded after)")
    docs = index.get("documents")
    if not isinstance(docs, list):
        raise bad("documents", "must be a list")
    seen = set()
    for n, d in enumerate(docs):
        if not isinstance(d, dict):
            raise bad(f"documents[{n}]", "must be an object")
        for name, typ in _FIELDS.items():
            v = d.get(name)
            if not isinstance(v, typ) or (typ is int and isinstance(v, bool)) or (typ is str and not v and name != "text"):
                raise bad(f"documents[{n}].{name}", f"must be a {'non-empty ' if typ is str else ''}{typ.__name__}, "
                          f"got {v!r:.40}")
        if d["id"] in seen:
            raise bad(f"documents[{n}].id", f"repeats id '{d['id']}'")
        seen.add(d["id"])
    suffix = index.get("unit_suffix", [])
    if not isinstance(suffix, list) or not all(type(t) is int for t in suffix):
        raise bad("unit_suffix", "must be a list of token ids")
    prefixes = index.get("prefixes", [])
    if not isinstance(prefixes, list):
        raise bad("prefixes", "must be a list")
    for n, p in enumerate(prefixes):
        for name, typ in _PREFIX_FIELDS.items():
            v = p.get(name) if isinstance(p, dict) else None
            if not isinstance(v, typ) or isinstance(v, bool) or (typ is str and not v):
                raise bad(f"prefixes[{n}].{name}", f"must be a{' non-empty' if typ is str else 'n'} {typ.__name__}, "
                          f"got {v!r:.40}")
    return docs
