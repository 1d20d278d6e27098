"""States named by content key, from the tiers a promptcache engine writes: Redis and a spill folder.

A ``promptcache`` engine with ``StoreConfig(remote=URL)`` publishes every state it encodes to
Redis under its content key (``keys.py``: the key hashes the model and tokenizer, the namespace,
and the tokens and positions the state was encoded with); one with ``StoreConfig(spill_dir=DIR)``
writes ``DIR/<key>.safetensors`` (within ``disk_lag`` seconds by default,
at once with ``disk_policy="through"``, only when memory evicts it with ``"on_evict"``). A vLLM connector given that URL or folder (``vllm-config --remote URL --spill-dir DIR``)
serves those states without a compiled folder: schema modules a server encoded, and documents of
a ``DocumentStore`` (``attach_separator``) on that engine.

* request side: ``keyed_params(model, states)``: ``states`` is ``[(key, tokens, shift), ...]`` in
  prompt order, ``shift`` the positions the state's keys are rotated by (a schema prompt's one
  offset for every module; a document unit's start);
* connector side: ``KeyedStates(remote, spill_dir, model)`` checks a request's params (the counts
  against the prompt, the salt), reads each state (the codec checks the content key in its header
  and its checksum; the shape against vLLM's model) and rotates it.

What the connector cannot check here is that a key names the prompt's own tokens (it would need
the schema, or the engine's model key): it trusts ``to_vllm_request``, which computed the keys
from the same layout as the token ids. A request that lies harms only its own answer: its salt
keeps its blocks apart from every other request's.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from pathlib import Path

import torch

from ...store.codec import CodecError, StateInfo, StatesFile
from .states import rotated
from .supply import VERSION, SupplyError, cache_salt

__all__ = ["KeyedStates", "is_keyed", "keyed_params"]

log = logging.getLogger(__name__)

KEPT = 256  # states the worker keeps in memory (least recently used dropped first)


def keyed_params(model: str, states) -> dict:
    """kv_transfer_params["promptcache"] naming ``states`` [(key, tokens, shift), ...] by content key."""
    return {"v": VERSION, "model": model, "states": [[k, int(n), int(shift)] for k, n, shift in states]}


def is_keyed(params) -> bool:
    return isinstance(params, dict) and "states" in params


class KeyedStates:
    """The Redis at ``remote`` and the spill folder ``spill_dir`` (either may be None), for vLLM's
    ``model`` (layers, kv_heads, head_dim)."""

    def __init__(self, remote: str | None = None, spill_dir: str | None = None, model: dict | None = None):
        self.remote = None
        if remote:
            from ...store.remote import RedisTier  # needs the redis client: only where a URL is given

            self.remote = RedisTier(remote)
        self.spill_dir = Path(spill_dir) if spill_dir else None
        self.model = model
        self.kept: OrderedDict[str, torch.Tensor] = OrderedDict()

    @property
    def configured(self) -> bool:
        return self.remote is not None or self.spill_dir is not None

    def check(self, params: dict, prompt_token_ids, salt: str | None) -> tuple[list[tuple[str, int, int]], int]:
        """(states, supplied tokens) of a request's params; ``SupplyError`` names what is wrong."""
        if not self.configured:
            raise SupplyError("the request names states by key, and the connector was given no Redis URL or spill "
                              "folder (vllm-config --remote URL / --spill-dir DIR)")
        states = params.get("states")
        if params.get("v") != VERSION or not isinstance(states, list) or not states or not all(
                isinstance(s, list) and len(s) == 3 and isinstance(s[0], str) and type(s[1]) is int and s[1] > 0
                and type(s[2]) is int for s in states):
            raise SupplyError(f"kv_transfer_params: version {VERSION} with 'states' a non-empty list of "
                              "[key, tokens, shift]")
        tokens = sum(s[1] for s in states)
        if len(prompt_token_ids or ()) <= tokens:
            raise SupplyError(f"the prompt has {len(prompt_token_ids or ())} tokens: it must extend the {tokens} "
                              "supplied ones")
        if salt != cache_salt(params):
            raise SupplyError("the request's cache_salt is not the one its kv_transfer_params need "
                              "(use promptcache.integrations.vllm.to_vllm_request)")
        return [tuple(s) for s in states], tokens

    def verify(self, states) -> None:
        """Read every state once (its checksum and shape), without keeping it; ``SupplyError`` for a
        missing or bad one."""
        for key, n, _ in states:
            if key not in self.kept:
                self._read(key, n)

    def kv(self, states, inv_freq: torch.Tensor) -> torch.Tensor:
        """kv [L, 2, H, T, D] of ``states``, each one's keys rotated by its shift."""
        out = []
        for key, n, shift in states:
            kv = self.kept.get(key)
            if kv is None:
                kv = self.kept[key] = self._read(key, n)
                if len(self.kept) > KEPT:
                    self.kept.popitem(last=False)
            else:
                self.kept.move_to_end(key)
            out.append(rotated(kv, inv_freq, shift))
        return torch.cat(out, dim=3)

    def _read(self, key: str, n: int) -> torch.Tensor:
        kv = None
        path = self.spill_dir / f"{key}.safetensors" if self.spill_dir is not None else None
        if path is not None and path.is_file():
            try:
                kv = StatesFile(path).read("kv", StateInfo(key))
            except CodecError as e:
                log.warning("promptcache: spill file %s is not used: %s", path, e)
        if kv is None and self.remote is not None:
            kv = self.remote.get(key)  # verified by the codec (key, checksum); None when absent or bad
        if kv is None:
            raise SupplyError(f"state {key[:12]} is in none of the connector's tiers (spill folder "
                              f"{self.spill_dir}, Redis {self.remote.where if self.remote else None})")
        m = self.model
        if m is not None and tuple(kv.shape) != (m["layers"], 2, m["kv_heads"], n, m["head_dim"]):
            raise SupplyError(f"state {key[:12]} has shape {tuple(kv.shape)}, vLLM's model and the request need "
                              f"({m['layers']}, 2, {m['kv_heads']}, {n}, {m['head_dim']})")
        return kv
