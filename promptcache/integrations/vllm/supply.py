"""Which stored states a vLLM request is given, and at which rotation: the one rule both sides apply.

vLLM's connector API lets a connector supply the KV entries of a *prefix* of a prompt's tokens;
vLLM computes the rest at its own contiguous positions. A PML prompt (docs/DESIGN.md §3) places
its cached spans at their schema positions, with gaps where modules are not imported, and its new
text after them. Attention depends only on query position minus key position, and a stored
token is never a query, so the PML layout is reproduced exactly when

* the prompt is ``supplied + run``: cached spans only, then new tokens only (prompt order), and
* the new tokens hold consecutive positions ``S .. S + m - 1`` with ``S`` past every cached
  position (so generation continues at ``S + m``, the layout's largest position + 1),

by rotating every supplied key by one shared offset ``T - S`` (``T``: the number of supplied
tokens, vLLM's position of the first computed token): a key stored at position ``p`` then sits
at ``p + T - S``, and a query at vLLM position ``T + j`` sees it at distance ``S + j - p``, as in
the layout. Prefix subsets have ``T == S`` (no rotation: a plain prefill); gapped imports and
union members have ``T < S``. A layout of any other shape (text or a parameter argument between
cached spans, a prompt that ends in a cached span) gets no states: vLLM computes it in full, and
the reason is logged.

``Supply.params`` travels as the request's ``kv_transfer_params["promptcache"]``; the connector
checks it against the compiled schema (``check``) before claiming a token, and the request's
``cache_salt`` must be ``cache_salt(params)``: vLLM's own prefix cache then keeps rotated blocks
apart from plain ones and from other offsets. Torch-free (both sides import it).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass

from ...errors import PromptCacheError
from ...layout import PromptLayout

__all__ = ["PARAMS_KEY", "Checked", "SchemaSpans", "Supply", "SupplyError", "cache_salt", "check", "supply"]

PARAMS_KEY = "promptcache"  # the key of kv_transfer_params this integration owns
VERSION = 1


class SupplyError(PromptCacheError, ValueError):
    """A request's states cannot be supplied; the message says why (the request is computed in full)."""

    exit_code = 1


@dataclass(frozen=True)
class Supply:
    """What to hand vLLM for one prompt: ``params`` (kv_transfer_params) and the counts they imply."""

    params: dict  # {"v", "schema", "digest", "model", "spans": [schema span index], "start": S}
    tokens: int  # T: supplied tokens (the prompt's first T token ids)
    offset: int  # T - S: the rotation of every supplied key, in positions

    @property
    def salt(self) -> str:
        return cache_salt(self.params)


def cache_salt(params: dict) -> str:
    """vLLM's ``cache_salt`` for requests given ``params``: equal exactly when the supplied states
    (schema, model, spans) and their rotation (start) are."""
    body = json.dumps(params, sort_keys=True, separators=(",", ":"))
    return "promptcache-" + hashlib.sha256(body.encode()).hexdigest()[:40]


def supply(layout: PromptLayout, model_digest: str) -> Supply:
    """The states vLLM is given for ``layout`` (a PML prompt's), or ``SupplyError`` saying why none."""
    if layout.schema is None:
        raise SupplyError("a plain prompt imports no schema: nothing to supply")
    spans = layout.spans
    k = next((i for i, s in enumerate(spans) if s.kind != "cached"), len(spans))
    head, run = spans[:k], spans[k:]
    if not head:
        raise SupplyError(f"the prompt starts with new text ({spans[0].name}): vLLM can be given only a prefix of "
                          "stored states")
    if not run:
        raise SupplyError("the prompt ends in a cached span: vLLM computes at least one token, and the layout has "
                          "no new token to start from")
    late = next((s for s in run if s.kind == "cached"), None)
    if late is not None:
        raise SupplyError(f"cached span {late.name!r} follows new text ({run[0].name}): vLLM can be given only a "
                          "prefix of stored states (text or an argument between imports)")
    positions = [p for s in run for p in s.position_ids]
    start, last_cached = positions[0], max(p for s in head for p in s.position_ids)
    if positions != list(range(start, start + len(positions))):
        raise SupplyError(f"the new tokens do not hold consecutive positions (from {start}): one rotation cannot "
                          "place them")
    if start <= last_cached:
        raise SupplyError(f"the new text starts at position {start}, not past the cached position {last_cached}")
    params = {"v": VERSION, "schema": layout.schema.name, "digest": layout.schema.schema.digest,
              "model": model_digest, "spans": [s.schema_index for s in head], "start": start}
    n = sum(len(s) for s in head)
    return Supply(params, n, n - start)


@dataclass(frozen=True)
class SchemaSpans:
    """A compiled schema as the connector checks requests against it (from its manifest)."""

    name: str
    digest: str
    model: str  # model digest (keys.model_digest): the model and tokenizer it was compiled with
    token_ids: dict[int, tuple[int, ...]]  # stored span index -> its token ids
    starts: dict[int, int]  # stored span index -> its first position


@dataclass(frozen=True)
class Checked:
    """A request's supply, checked: load ``spans`` (token ``tokens`` total), rotate by ``offset``."""

    spans: tuple[int, ...]
    tokens: int
    offset: int


def check(params, schema: SchemaSpans, prompt_token_ids, salt: str | None) -> Checked:
    """``params`` (a request's kv_transfer_params["promptcache"]) against the compiled ``schema``
    and the request's tokens and salt; ``SupplyError`` names the first thing wrong."""
    if not isinstance(params, dict) or params.get("v") != VERSION:
        raise SupplyError(f"kv_transfer_params['{PARAMS_KEY}'] is not a version-{VERSION} object")
    spans, start = params.get("spans"), params.get("start")
    if not isinstance(spans, list) or not spans or not all(type(i) is int for i in spans) or type(start) is not int:
        raise SupplyError("kv_transfer_params: 'spans' must be a non-empty list of span indices and 'start' an integer")
    if params.get("model") != schema.model:
        raise SupplyError(f"the request was laid out for model/tokenizer {str(params.get('model'))[:12]}, schema "
                          f"'{schema.name}' was compiled for {schema.model[:12]}")
    unknown = [i for i in spans if i not in schema.token_ids]
    if unknown:
        raise SupplyError(f"schema '{schema.name}' has no stored span {unknown[0]}")
    if spans != sorted(set(spans)):
        raise SupplyError("kv_transfer_params: 'spans' must be increasing (schema order)")
    ranges = sorted((schema.starts[i], schema.starts[i] + len(schema.token_ids[i])) for i in spans)
    if any(b[0] < a[1] for a, b in zip(ranges, ranges[1:])):
        raise SupplyError("kv_transfer_params: the spans overlap in positions (two members of one union)")
    if start < ranges[-1][1]:
        raise SupplyError(f"'start' {start} is not past the last supplied position {ranges[-1][1] - 1}")
    ids = [t for i in spans for t in schema.token_ids[i]]
    prompt = list(prompt_token_ids or ())
    if len(prompt) <= len(ids):
        raise SupplyError(f"the prompt has {len(prompt)} tokens: it must extend the {len(ids)} supplied ones")
    if prompt[: len(ids)] != ids:
        at = next(j for j, (a, b) in enumerate(zip(prompt, ids)) if a != b)
        raise SupplyError(f"prompt token {at} is {prompt[at]}, the schema's stored span there holds {ids[at]}")
    if salt != cache_salt(params):
        raise SupplyError("the request's cache_salt is not the one its kv_transfer_params need "
                          "(use promptcache.integrations.vllm.to_vllm_request)")
    return Checked(tuple(spans), len(ids), len(ids) - start)
