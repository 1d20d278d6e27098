"""The FastAPI app: OpenAI-compatible routes over one engine (``create_app``).

Routes: POST /v1/chat/completions, POST /v1/completions, GET /v1/models (these need a key when
the app has ``api_keys``), GET /health, GET /metrics (Prometheus text; no key, aggregate counts).

Tenancy: ``api_keys`` maps each key to a namespace; the namespace salts prefix blocks, schema
states and document states, and is never read from the request. Without ``api_keys`` every
request is in the engine's namespace (``pc.config.namespace``) and no key is checked.

A request is validated and planned (``prompts.Planner``) before it is queued; a streaming
answer starts only after its prompt ran, so an error before that is a plain HTTP error with its
status; an error after it (rare: the engine failing mid-decode) ends the stream with an
``error`` event. A client that disconnects cancels its request: at once when streaming, within
``DISCONNECT_POLL_S`` otherwise.
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


from . import protocol as P
from .backend import Backend, QueueFull
from .metrics import CONTENT_TYPE_LATEST, Metrics
from .prefix import DEFAULT_BLOCK_SIZE, PrefixCache
from .prompts import Planner
from .workerinfo import add_worker_routes

log = logging.getLogger(__name__)

DISCONNECT_POLL_S = 1.0  # a non-streaming request checks this often whether its client is still there


def create_app(pc, *, api_keys: dict[str, str] | None = None, documents=None, max_queue: int = 64,
               model_name: str = "promptcache", block_size: int = DEFAULT_BLOCK_SIZE) -> FastAPI:
    """An app serving ``pc`` (a PromptCache).

    ``api_keys``: key -> namespace (None: no keys, one namespace). ``documents``: a DocumentStore
    (served to requests of its namespace) or a dict namespace -> DocumentStore. ``max_queue``:
    requests admitted at once; one more is answered 503. ``block_size``: tokens per prefix block.
    """
    prefix = PrefixCache(pc, block_size)
    if documents is not None and not isinstance(documents, dict):
        documents = {documents.namespace: documents}
    planner = Planner(pc, prefix, documents)
    backend = Backend(pc, max_queue)
    metrics = Metrics(backend, prefix, pc.store)
    backend.on_finish = lambda job, how: metrics.finished.labels(how).inc()

    @asynccontextmanager
    async def lifespan(app):
        yield
        backend.close()
        pc.store.persist()  # a named spill folder keeps what memory held for the next start (no-op otherwise)

    app = FastAPI(title="promptcache", lifespan=lifespan)
    app.state.backend, app.state.prefix, app.state.metrics = backend, prefix, metrics

    def namespace(request: Request) -> str:
        if api_keys is None:
            return pc.config.namespace
        auth = request.headers.get("authorization", "")
        key = auth[7:].strip() if auth.lower().startswith("bearer ") else ""
        if key not in api_keys:
            raise P.APIError(401, "missing or invalid API key (send 'Authorization: Bearer KEY')",
                             code="invalid_api_key")
        return api_keys[key]

    async def parse(request: Request, cls):
        try:
            body = await request.json()
        except ValueError:
            raise P.APIError(400, "the request body is not valid JSON") from None
        try:
            req = cls.model_validate(body)
        except ValidationError as e:
            err = e.errors()[0]
            field = ".".join(str(x) for x in err["loc"]) or None
            raise P.APIError(400, f"{field}: {err['msg']}", field) from None
        if req.model != model_name:
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
        metrics.prompt_tokens.inc(plan.prompt_tokens)
        metrics.cached_tokens.inc(res.cached_tokens)
        rid = P.new_id("chatcmpl" if chat else "cmpl")

        def finish(gen):
            metrics.generated_tokens.inc(len(gen.token_ids))
            return gen.finish_reason, P.usage(plan.prompt_tokens, len(gen.token_ids), res.cached_tokens)

        metrics.requests.labels(request.url.path, "200").inc()
        if req.stream:
            include = bool(req.stream_options and req.stream_options.include_usage)
            return StreamingResponse(_sse(job, backend, rid, req.model, chat, include, finish),
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
                elif kind == "done":
                    reason, use = finish(value)
                    break
                else:
                    raise P.APIError(500, f"the engine failed: {value}")
        except asyncio.CancelledError:
            backend.cancel(job)
            raise
        make = P.chat_response if chat else P.completion_response
        return make(rid, req.model, "".join(text), reason, use)

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

    add_worker_routes(app, backend, model_name, block_size)  # what a router reads (README "Scaling out")
    return app


async def _sse(job, backend, rid, model, chat, include_usage, finish):
    """SSE events of one streamed answer; a client that goes away cancels the job."""
    def event(obj) -> str:
        return f"data: {json.dumps(obj)}\n\n"

    done = False
    try:
        if chat:
            yield event(P.chat_chunk(rid, model, {"role": "assistant", "content": ""}))
        while True:
            kind, value = await job.events.get()
            if kind == "text":
                yield event(P.chat_chunk(rid, model, {"content": value}) if chat
                            else P.completion_chunk(rid, model, value))
            elif kind == "done":
                done = True
                reason, use = finish(value)
                yield event(P.chat_chunk(rid, model, {}, reason) if chat
                            else P.completion_chunk(rid, model, "", reason))
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
