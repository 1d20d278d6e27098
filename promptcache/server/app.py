"""The FastAPI app over one engine (``create_app``): the parts built once, and the routes that use them.

Routes: POST /v1/chat/completions, POST /v1/completions, GET /v1/models (``openai/``), POST
/v1/messages and /v1/messages/count_tokens (``anthropic/``), POST /tokenize and /detokenize
(``openai/tokenize.py``), GET /studio and /studio/api/* (``studio/``; ``/`` redirects there),
GET /model_info and /server_info (``core/workerinfo.py``), GET /metrics (Prometheus text of
aggregate counts), GET /health. The API routes and /metrics need a key when the app has
``api_keys`` (``core/tenancy.py``; /metrics not with ``open_metrics``).

Every API route parses and prepares in its own terms and hands its request to the one
``Lifecycle`` (``core/lifecycle.py``: submit, await the prefill, map errors, count, stream or
collect; a client that disconnects cancels its request at once, queued, prefilling or decoding).
Every request gets one access-log line (``core/access.py``).

Before any route: ``limits.RequestGuard`` (Host allow-list, JSON content type, body size, JSON
depth, message and character counts). CORS headers only for ``cors_origins``. After a request
with a large body is answered, freed heap pages go back to the OS (``trim.py``). Preparing
(tokenizing, the chat template, PML layout) runs on one prep thread, never on the event loop
(``openai/prepare.py``). Any exception that escapes a route is logged and answered as an OpenAI
error object (500).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..engine import ServingConfig
from ..engine.serving_core.prefix import DEFAULT_BLOCK_SIZE
from ..store import Pins
from .anthropic.routes import MessagesContext, add_messages_route
from .core.access import AccessLog
from .core.backend import Backend
from .core.compute import ComputeThread
from .core.errors import APIError
from .core.lifecycle import Lifecycle
from .core.limits import LOOPBACK_HOSTS, Limits, RequestGuard
from .core.metrics import Metrics
from .core.tenancy import Tenancy
from .core.workerinfo import add_worker_routes
from .openai.prepare import Preparer, PrepThread
from .trim import TrimAfterLarge, Trimmer
from .openai.routes import add_openai_routes
from .openai.tokenize import add_tokenize_routes
from .studio.routes import StudioContext, add_studio_routes

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
    ``core/compute.py`` for why it matters). ``open_metrics``: GET /metrics answers without a key even
    when ``api_keys`` are set (for a scraper that sends none); by default it needs one then.
    """
    limits = limits or Limits()
    serving = dataclasses.replace(serving or ServingConfig(), block_size=block_size)
    context = _context(pc, max_model_len)
    if documents is not None and not isinstance(documents, dict):
        documents = {documents.namespace: documents}
    backend = Backend(pc, max_queue, config=serving, compute=compute or ComputeThread())
    preparer = Preparer(pc, documents, max_chars=limits.max_chars)
    preparer.context = context
    metrics = Metrics(backend, backend.prefix, pc.store)
    backend.on_finish = lambda job, how: metrics.finished.labels(how).inc()
    if pins is not None or pc.store.pins is None:
        pc.store.pins = pins if pins is not None else Pins(pc.config.store.pin_budget)
    prep, tenancy, lifecycle = PrepThread(), Tenancy(api_keys, pc.config.namespace), Lifecycle(backend, metrics)

    app = FastAPI(title="promptcache", lifespan=_lifespan(pc, backend, prep, drain_timeout))
    app.state.backend, app.state.prefix, app.state.metrics = backend, backend.prefix, metrics
    app.add_middleware(AccessLog)
    if cors_origins:
        app.add_middleware(CORSMiddleware, allow_origins=list(cors_origins), allow_methods=["GET", "POST"],
                           allow_headers=["authorization", "content-type"])
    app.add_middleware(RequestGuard, limits=limits, allowed_hosts=allowed_hosts)  # runs first of the checks
    app.state.trimmer = Trimmer()
    app.add_middleware(TrimAfterLarge, trimmer=app.state.trimmer)  # outermost: a refused large body counts too
    _add_error_handlers(app, metrics)

    add_openai_routes(app, lifecycle, preparer, prep, tenancy.namespace, model_name)
    add_messages_route(app, MessagesContext(pc, lifecycle, prep, backend.prefix, pc.store.pins, tenancy.namespace,
                                            model_name, context))
    add_tokenize_routes(app, preparer, prep, tenancy.namespace, model_name)
    _add_health_routes(app, backend, metrics, tenancy, open_metrics)
    add_worker_routes(app, backend, model_name, block_size)  # what a router reads (docs/scaling.md)
    add_studio_routes(app, StudioContext(pc, preparer, backend, lifecycle, tenancy.namespace, prep, model_name,
                                         tenants=tenancy.keyed))
    return app


def _context(pc, max_model_len: int | None) -> int | None:
    """Tokens a prompt plus its answer may use: the model's context (its sliding window if
    smaller), or less by ``max_model_len``."""
    context = pc.adapter.context_limit
    if max_model_len is None:
        return context
    if max_model_len < 1 or (context is not None and max_model_len > context):
        raise ValueError(f"max_model_len must be in [1, {context}] (the model's context), got {max_model_len}")
    return max_model_len


def _lifespan(pc, backend: Backend, prep: PrepThread, drain_timeout: float):
    @asynccontextmanager
    async def lifespan(app):
        yield
        await asyncio.get_running_loop().run_in_executor(None, backend.close, drain_timeout)
        prep.shutdown()
        backend.after_close(pc.store.persist)  # a named spill folder keeps what memory held for the next start (no-op otherwise)

    return lifespan


def _add_error_handlers(app: FastAPI, metrics: Metrics) -> None:
    @app.exception_handler(APIError)
    async def api_error(request: Request, e: APIError):
        metrics.requests.labels(request.url.path, str(e.status)).inc()
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, e: StarletteHTTPException):
        return JSONResponse(APIError(e.status_code, str(e.detail)).body(), status_code=e.status_code)

    @app.exception_handler(Exception)
    async def internal_error(request: Request, e: Exception):
        log.exception("%s %s failed", request.method, request.url.path)
        metrics.requests.labels(request.url.path, "500").inc()
        return JSONResponse(APIError(500, f"internal error ({type(e).__name__}); the server log has the details")
                            .body(), status_code=500)


def _add_health_routes(app: FastAPI, backend: Backend, metrics: Metrics, tenancy: Tenancy, open_metrics: bool) -> None:
    @app.get("/health")
    async def health():
        return {"status": "ok", "in_flight": backend.in_flight}

    @app.get("/metrics")
    async def metrics_route(request: Request):
        if not open_metrics:
            tenancy.namespace(request)  # with keys, a key: the counts tell who uses the server how much
        return Response(metrics.render(), media_type=metrics.content_type)
