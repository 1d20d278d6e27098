"""Fingerprints and content keys.

A stored state is determined by the model, the token IDs and positions of its encoding context
and its own tokens. Its key hashes exactly those, plus a namespace (a salt chosen by the caller):
identical modules of two schemas share one stored state; two namespaces never do. Shared states
would let one tenant learn from time to first token whether another used the same text.

Two encodings, one scheme (``_hasher`` + per-span update): ``content_keys`` for a schema's
spans (each hashes its pass's tokens and positions up to it) and ``alone_key`` for tokens encoded
alone from position ``start`` with no context (RAG documents and prefixes). The two carry
different domain tags, so a document never shares a key with a schema span.
"""

from __future__ import annotations

import hashlib
import json
from array import array

import torch

from .layout import SchemaLayout

_VOLATILE = {"_name_or_path", "transformers_version", "torch_dtype", "dtype", "_attn_implementation_autoset",
             "_commit_hash", "_attn_implementation_internal", "use_cache"}


def _sha(data: bytes | str) -> str:
    return hashlib.sha256(data.encode() if isinstance(data, str) else data).hexdigest()


@torch.no_grad()
def weights_hash(model, samples: int = 4096) -> str:
    """sha256 over every tensor's name, shape, dtype and up to ``samples`` evenly spaced values.

    Sampled, not full: a full hash of a 7B model reads 14 GB. Any retrained or differently
    initialized model differs in the samples; bit-for-bit identity is not claimed.
    """
    h = hashlib.sha256()
    for name, t in sorted(model.state_dict().items()):
        h.update(f"{name}:{tuple(t.shape)}:{t.dtype}".encode())
        flat = t.detach().reshape(-1)
        if flat.numel():
            k = min(samples, flat.numel())
            idx = torch.arange(k, device=flat.device) * (flat.numel() - 1) // max(k - 1, 1)  # exact integers
            h.update(flat[idx].float().cpu().numpy().tobytes())
    return h.hexdigest()


def model_fingerprint(model) -> dict[str, str]:
    cfg = {k: v for k, v in model.config.to_dict().items() if k not in _VOLATILE}
    return {
        "architecture": type(model).__name__,
        "model_type": str(getattr(model.config, "model_type", "")),
        "config_sha256": _sha(json.dumps(cfg, sort_keys=True, default=str)),
        "weights_sha256": weights_hash(model),
        "dtype": str(next(model.parameters()).dtype).removeprefix("torch."),
    }


def tokenizer_fingerprint(tokenizer) -> str:
    parts = [type(tokenizer).__name__]
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        parts.append(backend.to_str())
    else:
        parts.append(json.dumps(getattr(tokenizer, "get_vocab", dict)(), sort_keys=True))
    for attr in ("bos_token", "eos_token", "pad_token", "unk_token", "chat_template"):
        parts.append(f"{attr}={getattr(tokenizer, attr, None)!r}")
    parts.append(repr(tokenizer.encode("Prompt Cache probe: <s> 123 héllo\n  x")))
    return _sha("\0".join(parts))


PORTABLE = "\0portable"  # the namespace of keys recorded in files (no tenant name can equal it)


def model_digest(model_key: str) -> str:
    """A short, fixed-length name of a model + tokenizer (recorded in every stored state)."""
    return _sha(model_key)


def _hasher(domain: str, model_key: str, namespace: str):
    return hashlib.sha256(f"{domain}\0{namespace}\0{model_key}\0".encode())


def _add_span(h, token_ids, start: int, end: int) -> None:
    """Hash a span's tokens and its positions [start, end)."""
    h.update(array("q", token_ids).tobytes() + array("q", range(start, end)).tobytes() + b"|")


def _finish(h, n: int) -> str:
    end = h.copy()
    end.update(f"n={n}".encode())
    return end.hexdigest()


def content_keys(layout: SchemaLayout, model_key: str, namespace: str) -> dict[int, str]:
    """Stored span index -> content key, hashing its pass's tokens and positions up to it."""
    spans, keys = layout.spans, {}
    for p in layout.passes():
        h = _hasher("promptcache-v1", model_key, namespace)
        targets = set(p.targets)
        for i in p.spans:
            s = spans[i]
            _add_span(h, s.token_ids, s.start, s.end)
            if i in targets:
                keys[i] = _finish(h, len(s.token_ids))
    return keys


def alone_key(token_ids, model_key: str, namespace: str, start: int = 0) -> str:
    """Key of ``token_ids`` encoded alone (no context) at positions start..start+n-1."""
    h = _hasher("promptcache-alone-v1", model_key, namespace)
    _add_span(h, token_ids, start, start + len(token_ids))
    return _finish(h, len(token_ids))


def chain_root(model_key: str, namespace: str) -> str:
    """The parent of the first link of a chain (``chain_key``): names the model and namespace."""
    return _hasher("promptcache-chain-v1", model_key, namespace).hexdigest()


def chain_key(parent: str, token_ids, start: int) -> str:
    """Key of ``token_ids`` at positions start..start+n-1 encoded right after the chain ending in
    ``parent`` (a ``chain_root`` or another chain key, which already salts model and namespace):
    server prefix blocks and RAG document chains."""
    h = hashlib.sha256(f"promptcache-link-v1\0{parent}\0".encode())
    _add_span(h, token_ids, start, start + len(token_ids))
    return _finish(h, len(token_ids))


def token_digest(token_ids) -> str:
    """sha256 of token IDs (int64): names a document's states file."""
    return hashlib.sha256(array("q", token_ids).tobytes()).hexdigest()
