"""``PromptCacheConnector``: vLLM's KV connector over promptcache's compiled schemas and document stores.

Loaded by vLLM (``--kv-transfer-config``, see ``config.kv_transfer_config``); the only module of
the package that imports vllm. vLLM makes two instances:

* scheduler side: ``get_num_new_matched_tokens`` checks a request's
  ``kv_transfer_params["promptcache"]`` (``supply.check``: known schema, same model, the prompt's
  first tokens are the spans' tokens, the salt) and reads its states once (checksums), then claims
  the supplied tokens vLLM's prefix cache does not already hold; ``build_connector_meta`` hands
  the worker each claimed request's spans, token range, offset and block ids.
* worker side: ``start_load_kv`` concatenates the spans' states, rotates the keys by the offset
  (``supply`` explains why one offset is exact), keeps this tensor-parallel rank's heads and
  writes keys and values into vLLM's paged cache through the attention backend's own
  ``do_kv_cache_update`` (so every backend's block layout is its own business).

A request naming documents (``documents``: a ``DocumentStore`` folder's units, each rotated from
0 to its start) is checked and loaded the same way, from the folders of ``extra_config["documents"]``;
one naming states by content key (``keyed``) from the Redis ``extra_config["remote"]`` and the
spill folder ``extra_config["spill_dir"]`` an engine writes.

Errors never give a wrong answer: a request whose states cannot be supplied is computed in full
by vLLM (reason logged, at warning). Its blocks then enter vLLM's prefix cache under its salt,
so a later request with that salt would find plain blocks where it expects rotated ones: the
connector remembers refused salts and refuses them again. A load that fails on the worker (a
state damaged after the scheduler's check) is reported as vLLM load errors of the request's
blocks (``get_block_ids_with_load_errors``): vLLM's ``kv_load_failure_policy`` fails the request
("fail") or computes it from the first unwritten block ("recompute"); the scheduler side sees the
blocks in ``update_connector_output`` and refuses the request's salt from then on.

Keys are rotated at the frequencies vLLM's model uses (``rope.rope_inv_freq``: default, linear,
llama3, yarn); a rope it does not reproduce is refused by name, every request computed in full.
"""

from __future__ import annotations

import logging
import re
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (KVConnectorBase_V1, KVConnectorMetadata,
                                                               KVConnectorRole)

from ...store.codec import CodecError
from .documents import DocumentStates, Unit, is_documents
from .keyed import KeyedStates, is_keyed
from .rope import rope_inv_freq
from .states import CompiledStates, rotated
from .supply import PARAMS_KEY, SupplyError, check

__all__ = ["PromptCacheConnector"]

log = logging.getLogger(__name__)

REFUSED_SALTS = 65536  # salts remembered as computed in full (least recently refused forgotten first)


@dataclass
class Load:
    """One request's states to write: tokens [first, tokens) of its spans (a schema's, rotated by
    ``offset``) or of its document units (each rotated to its start), at ``slots``."""

    req_id: str
    salt: str | None
    schema: tuple[str, str] | None  # (name, digest); None for documents
    spans: tuple[int, ...]
    first: int  # the first token vLLM's own prefix cache does not hold
    tokens: int
    offset: int
    block_ids: list[int]
    units: tuple[Unit, ...] = ()  # documents: the prefix and each document's unit, in prompt order
    keyed: tuple[tuple[str, int, int], ...] = ()  # states by content key: (key, tokens, shift), in prompt order


@dataclass
class PromptCacheMetadata(KVConnectorMetadata):
    loads: list[Load] = field(default_factory=list)


class PromptCacheConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config, role: KVConnectorRole, kv_cache_config=None):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        hf = vllm_config.model_config.hf_text_config
        self.block_size = vllm_config.cache_config.block_size
        self.layers = hf.num_hidden_layers
        self.kv_heads = getattr(hf, "num_key_value_heads", None) or hf.num_attention_heads
        model = {"model_type": hf.model_type, "layers": self.layers, "kv_heads": self.kv_heads,
                 "head_dim": vllm_config.model_config.get_head_size()}
        folders = self._kv_transfer_config.get_from_extra_config("compiled", [])
        self.states = CompiledStates(folders, model)
        self.documents = DocumentStates(self._kv_transfer_config.get_from_extra_config("documents", []), model)
        self.keyed = KeyedStates(self._kv_transfer_config.get_from_extra_config("remote", None),
                                 self._kv_transfer_config.get_from_extra_config("spill_dir", None), model)
        try:
            self.inv_freq, self.rope_refusal = rope_inv_freq(hf), None
        except SupplyError as e:
            self.inv_freq, self.rope_refusal = None, str(e)
            log.error("promptcache: no states will be supplied: %s", e)
        self.tp_size = vllm_config.parallel_config.tensor_parallel_size
        self.claimed: dict[str, Load] = {}  # scheduler: checked, waiting for their blocks
        self.loads: dict[str, Load] = {}  # scheduler: blocks allocated, for the next metadata
        self.sent: dict[str, Load] = {}  # scheduler: handed to the workers, until the request finishes
        self.failed_blocks: set[int] = set()  # worker: blocks of loads that failed, for vLLM's next output
        self.refused: OrderedDict[str, None] = OrderedDict()

    # -- scheduler side -----------------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int, bool]:
        params = (request.kv_transfer_params or {}).get(PARAMS_KEY)
        if params is None:
            return 0, False
        load = self._check(request, params)
        if load is None:
            return 0, False
        if num_computed_tokens >= load.tokens:
            return 0, False  # vLLM's prefix cache holds them (an earlier request with this salt)
        self.claimed[request.request_id] = load
        return load.tokens - num_computed_tokens, False

    def _check(self, request, params) -> Load | None:
        salt = request.cache_salt
        try:
            if salt in self.refused:
                self.refused.move_to_end(salt)
                raise SupplyError("an earlier request with this cache_salt was computed in full, and vLLM's prefix "
                                  "cache may hold its plain blocks under it")
            if self.rope_refusal:
                raise SupplyError(self.rope_refusal)
            if not isinstance(params, dict):
                raise SupplyError(f"kv_transfer_params['{PARAMS_KEY}'] is not an object")
            if is_documents(params):
                units, tokens = self.documents.check(params, request.prompt_token_ids, salt)
                self.documents.verify(units)
                return Load(request.request_id, salt, None, (), 0, tokens, 0, [], units=tuple(units))
            if is_keyed(params):
                states, tokens = self.keyed.check(params, request.prompt_token_ids, salt)
                self.keyed.verify(states)
                return Load(request.request_id, salt, None, (), 0, tokens, 0, [], keyed=tuple(states))
            schema = self.states.schema(params.get("schema"), params.get("digest"))
            ok = check(params, schema, request.prompt_token_ids, salt)
            self.states.verify(schema.name, schema.digest, ok.spans)
        except SupplyError as e:
            log.warning("promptcache: request %s is computed in full by vLLM: %s", request.request_id, e)
            self._refuse(salt)
            return None
        return Load(request.request_id, salt, (schema.name, schema.digest), ok.spans, 0, ok.tokens, ok.offset, [])

    def _refuse(self, salt: str | None) -> None:
        if salt is not None:
            self.refused[salt] = None
            self.refused.move_to_end(salt)
            if len(self.refused) > REFUSED_SALTS:
                self.refused.popitem(last=False)

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int):
        load = self.claimed.pop(request.request_id, None)
        if load is not None and num_external_tokens > 0:
            load.first = load.tokens - num_external_tokens
            self.loads[request.request_id] = load

    def build_connector_meta(self, scheduler_output) -> KVConnectorMetadata:
        meta = PromptCacheMetadata()
        for new in scheduler_output.scheduled_new_reqs:
            load = self.loads.pop(new.req_id, None)
            if load is not None:
                load.block_ids = list(new.block_ids[0])
                meta.loads.append(load)
                self.sent[load.req_id] = load
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):  # resumed after preemption: all its blocks are new
            load = self.loads.pop(req_id, None)
            if load is not None and cached.new_block_ids[i] is not None:
                load.block_ids = list(cached.new_block_ids[i][0])
                meta.loads.append(load)
                self.sent[load.req_id] = load
        return meta

    def update_connector_output(self, connector_output) -> None:
        """A load the workers could not write (``invalid_block_ids``): vLLM fails the request or,
        with ``kv_load_failure_policy`` "recompute", computes its tokens from the first unwritten
        block as a plain prefill, and caches those blocks under the request's salt. The salt is
        refused from then on, so no later request reads them as rotated states."""
        invalid = set(getattr(connector_output, "invalid_block_ids", None) or ())
        if not invalid:
            return
        for load in list(self.sent.values()):
            if invalid.intersection(load.block_ids):
                log.warning("promptcache: request %s: its states could not be written (see the worker's log); "
                            "its cache_salt is refused from now on", load.req_id)
                self._refuse(load.salt)
                self.sent.pop(load.req_id, None)

    def request_finished(self, request, block_ids) -> tuple[bool, dict[str, Any] | None]:
        self.claimed.pop(request.request_id, None)
        self.loads.pop(request.request_id, None)
        self.sent.pop(request.request_id, None)
        return False, None

    # -- worker side ----------------------------------------------------------------------------------
    def start_load_kv(self, forward_context, **kwargs: Any) -> None:
        if not self.has_connector_metadata():
            return
        meta = self._get_connector_metadata()
        if not isinstance(meta, PromptCacheMetadata) or not meta.loads:
            return
        layers = _attention_layers(forward_context.no_compile_layers)
        if len(layers) != self.layers:
            raise RuntimeError(f"promptcache: found {len(layers)} attention layers with a KV cache, "
                               f"the model has {self.layers}")
        heads = self._rank_heads()
        for load in meta.loads:
            try:
                self._write(load, layers, heads)
            except (SupplyError, CodecError, OSError) as e:
                # vLLM fails the request, or recomputes it from the first of these blocks
                # (kv_load_failure_policy); the scheduler refuses its salt from then on
                first, last = load.first // self.block_size, (load.tokens - 1) // self.block_size
                self.failed_blocks.update(load.block_ids[first:last + 1])
                log.error("promptcache: request %s: states not written, reported to vLLM as a load failure: %s",
                          load.req_id, e)

    def _write(self, load: Load, layers: list, heads: slice) -> None:
        if load.units:  # documents: each unit rotated from 0 to its start
            kv = self.documents.kv(list(load.units), self.inv_freq)[:, :, heads, load.first:load.tokens]
        elif load.keyed:  # each state by its own shift
            kv = self.keyed.kv(list(load.keyed), self.inv_freq)[:, :, heads, load.first:load.tokens]
        else:
            kv = self.states.kv(*load.schema, load.spans)  # [L, 2, H, n, D]
            kv = rotated(kv[:, :, heads, load.first:load.tokens], self.inv_freq, load.offset)
        slots = _slots(load.block_ids, self.block_size, load.first, load.tokens)
        for i, layer in enumerate(layers):
            cache = layer.kv_cache
            key = kv[i, 0].transpose(0, 1).to(cache.dtype).contiguous()  # [n', H_rank, D]
            value = kv[i, 1].transpose(0, 1).to(cache.dtype).contiguous()
            layer.impl.do_kv_cache_update(layer, key.to(cache.device), value.to(cache.device), cache,
                                          slots.to(cache.device))
        log.debug("promptcache: request %s: wrote %d tokens (offset %d)", load.req_id, load.tokens - load.first,
                  load.offset)

    def get_block_ids_with_load_errors(self) -> set[int]:
        failed, self.failed_blocks = self.failed_blocks, set()
        return failed

    def _rank_heads(self) -> slice:
        """This rank's KV heads: a contiguous share, or one head replicated over several ranks."""
        if self.tp_size == 1:
            return slice(None)
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        rank = get_tensor_model_parallel_rank()
        if self.tp_size <= self.kv_heads:
            per = self.kv_heads // self.tp_size
            return slice(rank * per, (rank + 1) * per)
        h = rank * self.kv_heads // self.tp_size
        return slice(h, h + 1)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # start_load_kv writes every layer before the forward

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata, **kwargs: Any) -> None:
        return  # a consumer: states are compiled by promptcache, never saved from vLLM

    def wait_for_save(self):
        return


def _attention_layers(no_compile_layers: dict) -> list:
    """The attention layers holding a KV cache, in model order (by the layer number in their name)."""
    found = []
    for name, layer in no_compile_layers.items():
        cache = getattr(layer, "kv_cache", None)
        number = re.search(r"\.(\d+)\.", name)
        if isinstance(cache, torch.Tensor) and cache.numel() and hasattr(layer, "impl") and number:
            found.append((int(number.group(1)), layer))
    return [layer for _, layer in sorted(found, key=lambda x: x[0])]


def _slots(block_ids: list[int], block_size: int, first: int, end: int) -> torch.Tensor:
    """Slot of each token first..end-1 of a request: block_ids[i // block_size] * block_size + i % block_size."""
    i = torch.arange(first, end)
    return torch.tensor(block_ids, dtype=torch.long)[i // block_size] * block_size + i % block_size
