"""The FastAPI app: OpenAI-compatible routes over one engine (``create_app``).

Routes: POST /v1/chat/completions, POST /v1/completions, POST /v1/messages (Anthropic's Messages
API, ``anthropic.py``, and its /v1/messages/count_tokens), POST /tokenize and /detokenize
(``tokenize.py``), GET /v1/models, GET /metrics (these need a key when the app has ``api_keys``:
the ``Authorization: Bearer KEY`` header or ``x-api-key: KEY``; /metrics not with ``open_metrics``),
GET /health. /metrics is Prometheus text of aggregate counts. GET /studio (a web page; ``studio.py``; ``/``
redirects there).

Tenancy: ``api_keys`` maps each key to a namespace; the namespace salts prefix blocks, schema
states and document states, and is never read from the request. Without ``api_keys`` every
request is in the engine's namespace (``pc.config.namespace``) and no key is checked.

A request is validated and planned (``prompts.Planner``) before it is queued; a streaming
answer starts only after its prompt ran, so an error before that is a plain HTTP error with its
status; an error after it (rare: the engine failing mid-decode) ends the stream with an
``error`` event. A client that disconnects cancels its request at once, whether it is queued,
prefilling or decoding (the server listens for the disconnect while it waits; the scheduler frees
the request's blocks at its next step). Every request gets one access-log line (``access.py``).

Before any route: ``limits.RequestGuard`` (Host allow-list, JSON content type, body size, JSON
depth, message and character counts; see limits.py). CORS headers only for ``cors_origins``.
Planning (tokenizing, the chat template, PML layout) runs on one worker thread, never on the
event loop, so ``/health`` and running streams stay live while a large prompt is tokenized; one
thread keeps the planner's calls into the tokenizer and the engine serial, as they were on the
loop. Any exception that escapes a route is logged and answered as an OpenAI error object (500).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager

import torch
from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException


from ..engine.encoder import release_free_memory
from ..store import DEFAULT_PIN_BUDGET, Pins  # noqa: F401 - DEFAULT_PIN_BUDGET: its old home
from . import openai_fields
from . import protocol as P
from .access import AccessLog, note
from .anthropic import MessagesContext, add_messages_route
from .backend import Backend, QueueFull, ServingConfig
from .compute import ComputeThread
from .limits import LOOPBACK_HOSTS, Limits, RequestGuard, parsed_body
from .metrics import CONTENT_TYPE_LATEST, Metrics
from ..engine.prefix import DEFAULT_BLOCK_SIZE
from .prompts import Planner
from .studio import add_studio_routes
from .tokenize import add_tokenize_routes
from .toolcalls import CallStream, finish_reason, openai_deltas, parse as parse_calls
from .workerinfo import add_worker_routes

log = logging.getLogger(__name__)

def create_app(pc, *, api_keys: dict[str, str] | None = None, documents=None, max_queue: int = 64,
               model_name: str = "promptcache", block_size: int = DEFAULT_BLOCK_SIZE,
               serving: ServingConfig | None = None, drain_timeout: float = 10.0, limits: Limits | None = None,
               allowed_hosts: tuple[str, ...] | None = LOOPBACK_HOSTS, cors_origins: tuple[str, ...] = (),
               pins: Pins | None = None, max_model_len: int | None = None,
               compute: ComputeThread | None = None, open_metrics: bool = False) -> FastAPI:
    """An app serving ``pc`` (a PromptCache).

    ``api_keys``: key -> namespace (None: no keys, one namespace). ``documents``: a DocumentStore
    (served to requests of its namespace) or a dict namespace -> DocumentStore. ``max_queue``:
    requests admitted at once; one more is answered 503. ``block_size``: tokens per prefix block
    (and KV pool block). ``serving``: the serving core's pool and budgets. ``drain_timeout``:
    seconds running requests may go on at shutdown before they are cancelled.
    ``limits``: request limits (``limits.Limits()`` by default). ``allowed_hosts``: ``Host`` names
    answered (None: any; the default suits a server bound to loopback). ``cors_origins``: origins a
    browser page may call from (none by default).
    ``pins``: what ``cache_control`` breakpoints pin, set on ``pc.store`` (None: the store's pins,
    or new ones of the engine's ``config.store.pin_budget`` bytes). ``max_model_len``: prompt plus answer tokens a
    request may use (None: the model's context; more than it is a ValueError). ``compute``: the
    thread that loaded ``pc``'s model, to run the engine on (None: a thread of its own; see
    ``compute.py`` for why it matters). ``open_metrics``: GET /metrics answers without a key even
    when ``api_keys`` are set (for a scraper that sends none); by default it needs one then.
    """
    limits = limits or Limits()
    serving = serving or ServingConfig()
    serving = dataclasses.replace(serving, block_size=block_size)
    compute = compute or ComputeThread()
    context = pc.adapter.context_limit  # the model's context, its sliding window if smaller
    if max_model_len is not None and (max_model_len < 1 or (context is not None and max_model_len > context)):
        raise ValueError(f"max_model_len must be in [1, {context}] (the model's context), got {max_model_len}")
    if documents is not None and not isinstance(documents, dict):
        documents = {documents.namespace: documents}
    backend = Backend(pc, max_queue, config=serving, compute=compute)
    prefix = backend.prefix
    planner = Planner(pc, prefix, documents, max_chars=limits.max_chars)
    if max_model_len is not None:
        planner.context = max_model_len
    planning = ThreadPoolExecutor(max_workers=1, thread_name_prefix="promptcache-plan")
    metrics = Metrics(backend, prefix, pc.store)
    if pins is not None or pc.store.pins is None:
        pc.store.pins = pins if pins is not None else Pins(pc.config.store.pin_budget)
    backend.on_finish = lambda job, how: metrics.finished.labels(how).inc()

    @asynccontextmanager
    async def lifespan(app):
        yield
        await asyncio.get_running_loop().run_in_executor(None, backend.close, drain_timeout)
        planning.shutdown(wait=False, cancel_futures=True)
        backend.after_close(pc.store.persist)  # a named spill folder keeps what memory held for the next start (no-op otherwise)

    app = FastAPI(title="promptcache", lifespan=lifespan)
    app.add_middleware(AccessLog)
    app.state.backend, app.state.prefix, app.state.metrics = backend, prefix, metrics
    if cors_origins:
        app.add_middleware(CORSMiddleware, allow_origins=list(cors_origins), allow_methods=["GET", "POST"],
                           allow_headers=["authorization", "content-type"])
    app.add_middleware(RequestGuard, limits=limits, allowed_hosts=allowed_hosts)  # outermost: runs first

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
            req = cls.model_validate(parsed_body(request.scope))
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

    @app.exception_handler(Exception)
    async def internal_error(request: Request, e: Exception):
        log.exception("%s %s failed", request.method, request.url.path)
        metrics.requests.labels(request.url.path, "500").inc()
        return JSONResponse(P.APIError(500, f"internal error ({type(e).__name__}); the server log has the details")
                            .body(), status_code=500)

    def planned(how, req, ns):
        """``how(req, ns)`` (a Planner method); a refused plan gives the heap it grew back to the OS
        (tokenizing 2M characters leaves ~200 MB in glibc's arenas otherwise)."""
        try:
            return how(req, ns)
        except P.APIError:
            release_free_memory(torch.device("cpu"))
            raise

    async def make_plan(how, req, ns):
        """``how(req, ns)`` on the planning thread."""
        return await asyncio.get_running_loop().run_in_executor(planning, planned, how, req, ns)

    async def serve(request: Request, req, plan, chat: bool):
        try:
            job = backend.submit(plan.prompt, plan.params, plan.constraints, plan.logprobs)
        except QueueFull as e:
            raise P.APIError(503, f"the server is busy: {e}; retry later") from None
        watcher = asyncio.create_task(_watch_disconnect(request, job, backend))
        kind = None
        try:
            kind, res = await job.events.get()  # the prompt ran (or failed) before any answer starts
        except asyncio.CancelledError:
            backend.cancel(job)
            raise
        finally:
            if req.stream or kind != "prefilled":  # a stream's response listens for the disconnect itself
                watcher.cancel()
        if kind == "error" and isinstance(res, asyncio.CancelledError):  # the client went away while queued
            return Response(status_code=499)
        if kind == "error":
            raise P.APIError(500, f"the engine failed: {res}")
        metrics.ttft.observe(time.perf_counter() - job.submitted)
        note(request, prompt=plan.prompt_tokens, cached=res.cached_tokens, ttft=time.perf_counter() - job.submitted)
        metrics.prompt_tokens.inc(plan.prompt_tokens)
        metrics.cached_tokens.inc(res.reused_tokens)  # recomputed tokens were not served from stored states
        rid = P.new_id("chatcmpl" if chat else "cmpl")

        def finish(gen):
            metrics.generated_tokens.inc(len(gen.token_ids))
            note(request, generated=len(gen.token_ids))
            return gen.finish_reason, P.usage(plan.prompt_tokens, len(gen.token_ids), res.reused_tokens, res.exact,
                                              res.recomputed_tokens)

        def logprobs(entries, start: int = 0):  # entries: TokenLogprob list or None
            if chat:
                return openai_fields.chat_logprobs(pc.tokenizer, entries)
            return openai_fields.completion_logprobs(pc.tokenizer, entries, start)

        metrics.requests.labels(request.url.path, "200").inc()
        if req.stream:
            include = bool(req.stream_options and req.stream_options.include_usage)
            calls = CallStream() if plan.tool_calls else None
            return StreamingResponse(_sse(job, backend, rid, req.model, chat, include, finish, logprobs, calls),
                                     media_type="text/event-stream")
        text = []
        try:
            while True:
                kind, value = await job.events.get()
                if kind == "text":
                    text.append(value)
                elif kind == "logprob":
                    continue  # the Generation carries them all
                elif kind == "done":
                    reason, use = finish(value)
                    break
                elif isinstance(value, asyncio.CancelledError):  # the client went away (the watcher cancelled)
                    return Response(status_code=499)
                else:
                    raise P.APIError(500, f"the engine failed: {value}")
        except asyncio.CancelledError:
            backend.cancel(job)
            raise
        finally:
            watcher.cancel()
        if plan.tool_calls:
            content, calls = parse_calls("".join(text))
            return P.chat_response(rid, req.model, content, finish_reason(reason, calls), use, logprobs(value.logprobs),
                                   [c.openai() for c in calls])
        make = P.chat_response if chat else P.completion_response
        return make(rid, req.model, "".join(text), reason, use, logprobs(value.logprobs))

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        ns = namespace(request)
        req = await parse(request, P.ChatRequest)
        return await serve(request, req, await make_plan(planner.chat, req, ns), chat=True)

    @app.post("/v1/completions")
    async def completions(request: Request):
        ns = namespace(request)
        req = await parse(request, P.CompletionRequest)
        return await serve(request, req, await make_plan(planner.completion, req, ns), chat=False)

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
    async def metrics_route(request: Request):
        if not open_metrics:
            namespace(request)  # with keys, a key: the counts tell who uses the server how much
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    add_worker_routes(app, backend, model_name, block_size)  # what a router reads (docs/scaling.md)
    add_studio_routes(app, pc, planner, prefix, backend, namespace, planning, model_name,  # /studio (studio.py)
                      tenants=api_keys is not None)
    return app


async def _watch_disconnect(request: Request, job, backend) -> None:
    """Cancel ``job`` the moment its client disconnects (the body is read: the next ASGI message
    is the disconnect). Runs while the handler waits, so a queued or prefilling request whose
    client left is freed at the scheduler's next step."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            backend.cancel(job)
            return


async def _sse(job, backend, rid, model, chat, include_usage, finish, logprobs, calls: CallStream | None = None):
    """SSE events of one streamed answer; a client that goes away cancels the job. Token
    log-probabilities ride on the next text chunk (text held back for a stop string, or as a
    possible tool call, lags its tokens), the rest on the finishing chunk. ``calls``: the answer
    is parsed for tool calls (each sent whole, once its block closes)."""
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
            elif kind == "text" and calls is not None:
                for delta in openai_deltas(calls.feed(value), calls):
                    lp, pending = (logprobs(pending) if pending else None), []
                    yield event(P.chat_chunk(rid, model, delta, logprobs=lp))
            elif kind == "text":
                lp = logprobs(pending, sent) if pending else None
                pending, sent = [], sent + len(value)
                yield event(P.chat_chunk(rid, model, {"content": value}, logprobs=lp) if chat
                            else P.completion_chunk(rid, model, value, logprobs=lp))
            elif kind == "done":
                done = True
                reason, use = finish(value)
                if calls is not None:
                    for delta in openai_deltas(calls.close(), calls):
                        lp, pending = (logprobs(pending) if pending else None), []
                        yield event(P.chat_chunk(rid, model, delta, logprobs=lp))
                    reason = finish_reason(reason, calls.calls)
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
