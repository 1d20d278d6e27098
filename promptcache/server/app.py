"""The FastAPI app: OpenAI-compatible routes over one engine (``create_app``).

Routes: POST /v1/chat/completions, POST /v1/completions, POST /v1/messages (Anthropic's Messages
API, ``anthropic.py``), POST /tokenize and /detokenize (``tokenize.py``), GET /v1/models (these need a key when the app has ``api_keys``: the
``Authorization: Bearer KEY`` header or ``x-api-key: KEY``), GET /health, GET /metrics
(Prometheus text; no key, aggregate counts).

Tenancy: ``api_keys`` maps each key to a namespace; the namespace salts prefix blocks, schema
states and document states, and is never read from the request. Without ``api_keys`` every
request is in the engine's namespace (``pc.config.namespace``) and no key is checked.

A request is validated and planned (``prompts.Planner``) before it is queued; a streaming
answer starts only after its prompt ran, so an error before that is a plain HTTP error with its
status; an error after it (rare: the engine failing mid-decode) ends the stream with an
``error`` event. A client that disconnects cancels its request: at once when streaming, within
``DISCONNECT_POLL_S`` otherwise. Every request gets one access-log line (``access.py``).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException


from . import openai_fields
from . import protocol as P
from .access import AccessLog, note
from ..store import Pins
from .anthropic import MessagesContext, add_messages_route
from .backend import Backend, QueueFull
from .metrics import CONTENT_TYPE_LATEST, Metrics
from .prefix import DEFAULT_BLOCK_SIZE, PrefixCache
from .prompts import Planner
from .tokenize import add_tokenize_routes

log = logging.getLogger(__name__)

DISCONNECT_POLL_S = 1.0  # a non-streaming request checks this often whether its client is still there
DEFAULT_PIN_BUDGET = 1 << 30  # bytes of states cache_control breakpoints may pin at once


def create_app(pc, *, api_keys: dict[str, str] | None = None, documents=None, max_queue: int = 64,
               model_name: str = "promptcache", block_size: int = DEFAULT_BLOCK_SIZE,
               pins: Pins | None = None, max_model_len: int | None = None) -> FastAPI:
    """An app serving ``pc`` (a PromptCache).

    ``api_keys``: key -> namespace (None: no keys, one namespace). ``documents``: a DocumentStore
    (served to requests of its namespace) or a dict namespace -> DocumentStore. ``max_queue``:
    requests admitted at once; one more is answered 503. ``block_size``: tokens per prefix block.
    ``pins``: what ``cache_control`` breakpoints pin, set on ``pc.store`` (None: the store's pins,
    or new ones of ``DEFAULT_PIN_BUDGET`` bytes). ``max_model_len``: prompt plus answer tokens a
    request may use (None: the model's context; more than it is a ValueError).
    """
    prefix = PrefixCache(pc, block_size)
    if documents is not None and not isinstance(documents, dict):
        documents = {documents.namespace: documents}
    planner = Planner(pc, prefix, documents)
    if max_model_len is not None:
        if max_model_len < 1 or (planner.context is not None and max_model_len > planner.context):
            raise ValueError(f"max_model_len must be in [1, {planner.context}] (the model's context), got {max_model_len}")
        planner.context = max_model_len
    backend = Backend(pc, max_queue)
    metrics = Metrics(backend, prefix, pc.store)
    if pins is not None or pc.store.pins is None:
        pc.store.pins = pins if pins is not None else Pins(DEFAULT_PIN_BUDGET)
    backend.on_finish = lambda job, how: metrics.finished.labels(how).inc()

    @asynccontextmanager
    async def lifespan(app):
        yield
        backend.close()

    app = FastAPI(title="promptcache", lifespan=lifespan)
    app.add_middleware(AccessLog)
    app.state.backend, app.state.prefix, app.state.metrics = backend, prefix, metrics

    def namespace(request: Request) -> str:
        if api_keys is None:
            return pc.config.namespace
        auth = request.headers.get("authorization", "")
        key = auth[7:].strip() if auth.lower().startswith("bearer ") else request.headers.get("x-api-key", "")
        if key not in api_keys:
            raise P.APIError(401, "missing or invalid API key (send 'Authorization: Bearer KEY' or 'x-api-key: KEY')",
                             code="invalid_api_key")
        return api_keys[key]

    async def parse(request: Request, cls, check: bool = True):
        try:
            body = await request.json()
        except ValueError:
            raise P.APIError(400, "the request body is not valid JSON") from None
        try:
            req = cls.model_validate(body)
        except ValidationError as e:
            err = e.errors()[0]
            field = ".".join(str(x) for x in err["loc"]) or None
            msg = "is not supported by this server" if err["type"] == "extra_forbidden" else err["msg"]
            raise P.APIError(400, f"{field}: {msg}", field) from None
        if check and req.model != model_name:
            raise P.APIError(404, f"model '{req.model}' does not exist (this server serves '{model_name}')",
                             "model", "model_not_found")
        return req

    @app.exception_handler(P.APIError)
    async def api_error(request: Request, e: P.APIError):
        metrics.requests.labels(request.url.path, str(e.status)).inc()
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, e: StarletteHTTPException):
        return JSONResponse(P.APIError(e.status_code, str(e.detail)).body(), status_code=e.status_code)

    async def serve(request: Request, req, plan, chat: bool):
        try:
            job = backend.submit(plan.start, plan.sampling)
        except QueueFull as e:
            raise P.APIError(503, f"the server is busy: {e}; retry later") from None
        except ValueError as e:  # sampling settings the engine refuses (SamplingParams names the field)
            raise P.APIError(400, str(e)) from None
        try:
            kind, res = await job.events.get()  # the prompt ran (or failed) before any answer starts
        except asyncio.CancelledError:
            backend.cancel(job)
            raise
        if kind == "error":
            raise P.APIError(500, f"the engine failed: {res}")
        metrics.ttft.observe(time.perf_counter() - job.submitted)
        note(request, prompt=plan.prompt_tokens, cached=res.cached_tokens, ttft=time.perf_counter() - job.submitted)
        metrics.prompt_tokens.inc(plan.prompt_tokens)
        metrics.cached_tokens.inc(res.cached_tokens)
        rid = P.new_id("chatcmpl" if chat else "cmpl")

        def finish(gen):
            metrics.generated_tokens.inc(len(gen.token_ids))
            note(request, generated=len(gen.token_ids))
            return gen.finish_reason, P.usage(plan.prompt_tokens, len(gen.token_ids), res.cached_tokens)

        def logprobs(entries, start: int = 0):  # entries: TokenLogprob list or None
            if chat:
                return openai_fields.chat_logprobs(pc.tokenizer, entries)
            return openai_fields.completion_logprobs(pc.tokenizer, entries, start)

        metrics.requests.labels(request.url.path, "200").inc()
        if req.stream:
            include = bool(req.stream_options and req.stream_options.include_usage)
            return StreamingResponse(_sse(job, backend, rid, req.model, chat, include, finish, logprobs),
                                     media_type="text/event-stream")
        text, checked = [], time.monotonic()
        try:
            while True:
                try:
                    kind, value = await asyncio.wait_for(job.events.get(), DISCONNECT_POLL_S)
                except TimeoutError:
                    kind = None
                if time.monotonic() - checked >= DISCONNECT_POLL_S:
                    checked = time.monotonic()
                    if await request.is_disconnected():  # the client gave up waiting: stop decoding
                        backend.cancel(job)
                        return Response(status_code=499)
                if kind is None:
                    continue
                if kind == "text":
                    text.append(value)
                elif kind == "logprob":
                    continue  # the Generation carries them all
                elif kind == "done":
                    reason, use = finish(value)
                    break
                else:
                    raise P.APIError(500, f"the engine failed: {value}")
        except asyncio.CancelledError:
            backend.cancel(job)
            raise
        make = P.chat_response if chat else P.completion_response
        return make(rid, req.model, "".join(text), reason, use, logprobs(value.logprobs))

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        ns = namespace(request)
        req = await parse(request, P.ChatRequest)
        return await serve(request, req, planner.chat(req, ns), chat=True)

    @app.post("/v1/completions")
    async def completions(request: Request):
        ns = namespace(request)
        req = await parse(request, P.CompletionRequest)
        return await serve(request, req, planner.completion(req, ns), chat=False)

    add_messages_route(app, MessagesContext(pc, backend, prefix, metrics, pc.store.pins, namespace, model_name,
                                            planner.context))
    add_tokenize_routes(app, pc, planner, namespace, parse, model_name)

    @app.get("/v1/models")
    async def models(request: Request):
        namespace(request)
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": 0,
                                            "owned_by": "promptcache"}]}

    @app.get("/health")
    async def health():
        return {"status": "ok", "in_flight": backend.in_flight}

    @app.get("/metrics")
    async def metrics_route():
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    return app


async def _sse(job, backend, rid, model, chat, include_usage, finish, logprobs):
    """SSE events of one streamed answer; a client that goes away cancels the job. Token
    log-probabilities ride on the next text chunk (text held back for a stop string lags its
    tokens), the rest on the finishing chunk."""
    def event(obj) -> str:
        return f"data: {json.dumps(obj)}\n\n"

    done, pending, sent = False, [], 0  # pending: TokenLogprobs not sent yet; sent: text characters sent
    try:
        if chat:
            yield event(P.chat_chunk(rid, model, {"role": "assistant", "content": ""}))
        while True:
            kind, value = await job.events.get()
            if kind == "logprob":
                pending.append(value)
            elif kind == "text":
                lp = logprobs(pending, sent) if pending else None
                pending, sent = [], sent + len(value)
                yield event(P.chat_chunk(rid, model, {"content": value}, logprobs=lp) if chat
                            else P.completion_chunk(rid, model, value, logprobs=lp))
            elif kind == "done":
                done = True
                reason, use = finish(value)
                lp = logprobs(pending, sent) if pending else None
                yield event(P.chat_chunk(rid, model, {}, reason, logprobs=lp) if chat
                            else P.completion_chunk(rid, model, "", reason, logprobs=lp))
                if include_usage:
                    yield event(P.chat_chunk(rid, model, {}, use=use) if chat
                                else P.completion_chunk(rid, model, "", use=use))
                yield "data: [DONE]\n\n"
                return
            else:
                done = True
                yield event(P.APIError(500, f"the engine failed: {value}").body())
                return
    finally:
        if not done:
            backend.cancel(job)
