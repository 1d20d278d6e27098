"""The OpenAI request fields beyond plain sampling: ``logprobs`` / ``top_logprobs``,
``response_format``, ``prompt_cache_key``, and the refusals (tools: ``tools.py``).

Decisions:
  * Unknown fields are refused (the request models forbid extras; 400 naming the field), so a
    client that asks for a logit bias gets an error, never an answer that ignored it. ``tools``,
    ``tool_choice`` and ``parallel_tool_calls`` are ``tools.py``'s.
    Accepted with no effect on the answer: ``user``, ``metadata``, ``prompt_cache_key`` (prefix
    reuse is automatic and keyed by content; the key is kept for a router that places requests
    by it), ``frequency_penalty`` / ``presence_penalty`` at 0, ``response_format`` ``text``.
  * ``logprobs`` are log_softmax of the model's raw logits (before temperature, top-p or a JSON
    constraint), as vLLM reports them. Chat: ``logprobs: true`` and ``top_logprobs`` in [0, 20];
    completions: ``logprobs`` in [0, 5] (the number of rivals). A token's text is its decoded
    string (an incomplete UTF-8 piece shows as U+FFFD; ``bytes`` are that string's UTF-8).
  * ``response_format``: ``json_object`` constrains the answer to one JSON object and
    ``json_schema`` to its ``json_schema.schema`` (``engine.decoding.constrained``, xgrammar).
"""

from __future__ import annotations

from ...engine.decoding.constrained import ConstraintError, json_processor
from ..core.errors import APIError
from .protocol import BaseRequest, ChatRequest, CompletionRequest

MAX_TOP_LOGPROBS = {"chat": 20, "completion": 5}


def check(req: BaseRequest) -> None:
    """400 for accepted fields holding values this server does not serve."""
    for name in ("frequency_penalty", "presence_penalty"):
        v = getattr(req, name)
        if v:
            raise APIError(400, f"{name}={v} is not supported (only 0)", name)
    if isinstance(req, ChatRequest):
        if req.top_logprobs is not None and not req.logprobs:
            raise APIError(400, "top_logprobs needs logprobs: true", "top_logprobs")
        if req.top_logprobs is not None and not 0 <= req.top_logprobs <= MAX_TOP_LOGPROBS["chat"]:
            raise APIError(400, f"top_logprobs must be in [0, 20], got {req.top_logprobs}", "top_logprobs")
    elif req.logprobs is not None and not 0 <= req.logprobs <= MAX_TOP_LOGPROBS["completion"]:
        raise APIError(400, f"logprobs must be in [0, 5], got {req.logprobs}", "logprobs")


def logprobs_k(req: BaseRequest) -> int | None:
    """The engine's setting: None (no log-probabilities) or the number of rivals per token."""
    if isinstance(req, ChatRequest):
        return (req.top_logprobs or 0) if req.logprobs else None
    return req.logprobs if isinstance(req, CompletionRequest) else None


def constraints(req: BaseRequest, pc) -> tuple:
    """Fresh logits processors for ``response_format`` (empty for text)."""
    fmt = getattr(req, "response_format", None)
    if fmt is None or fmt.type == "text":
        return ()
    schema = None
    if fmt.type == "json_schema":
        if fmt.json_schema is None or not isinstance(fmt.json_schema.get("schema"), dict):
            raise APIError(400, "response_format json_schema needs json_schema.schema (an object)",
                           "response_format.json_schema")
        schema = fmt.json_schema["schema"]
    try:
        return (json_processor(pc.tokenizer, pc.model.config.vocab_size, schema),)
    except ConstraintError as e:
        raise APIError(400, str(e), "response_format") from None
    except ImportError as e:  # this server lacks the 'structured' extra
        raise APIError(400, f"response_format {fmt.type} is not available on this server: {e}", "response_format") from None


def _token(tok, token_id: int) -> dict:
    text = tok.decode([token_id])
    return {"token": text, "bytes": list(text.encode("utf-8"))}


def chat_logprobs(tok, entries) -> dict | None:
    """``choices[].logprobs`` of a chat answer: ``{"content": [...]}`` (None when not asked)."""
    if entries is None:
        return None
    return {"content": [{**_token(tok, e.token_id), "logprob": e.logprob,
                         "top_logprobs": [{**_token(tok, t), "logprob": lp} for t, lp in e.top]}
                        for e in entries]}


def completion_logprobs(tok, entries, start: int = 0) -> dict | None:
    """``choices[].logprobs`` of a completion (the legacy shape); ``start``: text offset of the first."""
    if entries is None:
        return None
    tokens = [tok.decode([e.token_id]) for e in entries]
    offsets, at = [], start
    for t in tokens:
        offsets.append(at)
        at += len(t)
    return {"tokens": tokens, "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": [{tok.decode([t]): lp for t, lp in e.top} for e in entries], "text_offset": offsets}
