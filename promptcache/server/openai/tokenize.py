"""``POST /tokenize`` and ``POST /detokenize``, in vLLM's shapes.

    /tokenize   {"prompt": str} or {"messages": [...], "add_generation_prompt": true}
                -> {"tokens": [ids], "count": n, "max_model_len": context}
    /detokenize {"tokens": [ids]} -> {"prompt": text}

Messages are rendered exactly as a chat request's (``Preparer.chat_ids``: the chat template with
the generation prompt), so ``count`` is the prompt size a chat request would have; a plain prompt
is tokenized as a completion's is (special tokens such as BOS added). Both need a key when the
server has keys; ``model``, when sent, must be the served one.
"""

from __future__ import annotations

import json
from typing import Callable

from fastapi import FastAPI, Request
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict

from ..core.errors import APIError
from .prepare import Preparer, PrepThread
from .protocol import Message, parse


IDS_PER_PIECE = 8192  # ids rendered per json.dumps call: each call holds the GIL, the loop waits meanwhile


def _json_ids(ids) -> bytes:
    """``ids`` as a JSON array, rendered in pieces so the event loop's thread gets the GIL between
    them (one call over 500K ids holds it for ~0.2 s)."""
    ids = list(ids)
    return b"[" + b",".join(json.dumps(ids[i:i + IDS_PER_PIECE])[1:-1].encode()
                            for i in range(0, len(ids), IDS_PER_PIECE)) + b"]"


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    prompt: str | None = None
    messages: list[Message] | None = None
    add_generation_prompt: bool = True
    add_special_tokens: bool = True


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    tokens: list[int]


def add_tokenize_routes(app: FastAPI, preparer: Preparer, prep: PrepThread, namespace: Callable[[Request], str],
                        model_name: str) -> None:
    """``namespace(request)``: the key check (APIError 401). Validating, tokenizing and rendering
    the answer run on ``prep``, never the event loop (a 2 MB prompt is ~500K ids)."""
    pc = preparer.pc
    vocab = pc.model.config.vocab_size

    def check_model(req):
        if req.model is not None and req.model != model_name:
            raise APIError(404, f"model '{req.model}' does not exist (this server serves '{model_name}')",
                           "model", "model_not_found")

    def tokenized(request: Request) -> dict:
        req = parse(request, TokenizeRequest)
        check_model(req)
        if (req.prompt is None) == (req.messages is None):
            raise APIError(400, "send either 'prompt' or 'messages'", "prompt")
        if req.messages is not None:
            if not req.add_generation_prompt:
                raise APIError(400, "add_generation_prompt=false is not supported (chat requests always add it)",
                               "add_generation_prompt")
            ids = preparer.chat_ids(preparer.chat_messages(req.messages))
        else:
            ids = pc.tokenizer(req.prompt, add_special_tokens=req.add_special_tokens).input_ids
        return Response(b'{"tokens":' + _json_ids(ids) + b',"count":%d,"max_model_len":%s}'
                        % (len(ids), json.dumps(preparer.context).encode()), media_type="application/json")

    def detokenized(request: Request) -> dict:
        req = parse(request, DetokenizeRequest)
        check_model(req)
        bad = next((t for t in req.tokens if not 0 <= t < vocab), None)
        if bad is not None:
            raise APIError(400, f"token ids must be in [0, {vocab}), got {bad}", "tokens")
        return {"prompt": pc.tokenizer.decode(req.tokens)}

    @app.post("/tokenize")
    async def tokenize(request: Request):
        namespace(request)
        return await prep.respond(tokenized, request)

    @app.post("/detokenize")
    async def detokenize(request: Request):
        namespace(request)
        return await prep.respond(detokenized, request)
