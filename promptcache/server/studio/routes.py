"""The studio: a web page at ``/studio`` (``/`` redirects there) and the JSON routes it draws from.

    GET  /studio                 the page (static/studio/: HTML, CSS, JS; no build step, no CDN)
    GET  /studio/static/NAME     its files
    GET  /studio/api/info        model, the caller's namespace and schemas, block size, pool or not
    POST /studio/api/schema      {"name": loaded schema} or {"pml": schema text} -> the layout as bars
                                 (views.schema_view); bad PML: 400 with "line" and "reason",
                                 as ``promptcache validate`` reports them
    POST /studio/api/prompt      {"pml": prompt} or {"messages": [...]}, optional "recompute" -> spans
                                 with where their states are, the layout's gaps, ``exact`` or why not
    POST /studio/api/full        the same body plus "max_tokens": an SSE stream of a full prefill's
                                 answer (no stored state), beside the cached one the page streams
                                 from /v1/chat/completions
    GET  /studio/api/cache       the cache view for the caller's namespace (cache.py)

The page itself holds no data and needs no key; every JSON route takes the API's keys (the page
asks for one when a route answers 401) and shows only the key's namespace. A schema posted as
text is laid out with the tokenizer only (never encoded or added) and may not read files:
``src=`` resolves inside an empty folder, so it is refused with its line (DESIGN.md §8: schemas
with files are the operator's). Requests' counts for the hit-rate series are taken by
``TrafficTap`` after each API answer (from what the routes ``note`` for the access log).
"""

from __future__ import annotations

import tempfile
import time
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Callable

from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse, RedirectResponse, Response
from pydantic import BaseModel, ConfigDict, ValidationError

from ...engine import PromptCache, SamplingParams, TokenPrompt
from ...engine.schemas.assemble import leading_exact
from ...engine.prefill.results import Generation, PrefillResult
from ...layout import layout_prompt, layout_schema
from ...pml import PMLError, PMLErrors, parse_prompt
from ..core.backend import Backend
from ..core.counts import TokenCounts
from ..core.errors import APIError
from ..core.events import EventSink
from ..core.lifecycle import Exchange, Lifecycle, Submission, sse
from ..core.limits import SCOPE_KEY
from ..openai.prepare import Preparer, PrepThread
from ..openai.protocol import Message, parse
from . import cache as studio_cache
from . import views as studio_views
from .cache import Traffic

STATIC = resources.files("promptcache.server") / "static" / "studio"
TYPES = {".html": "text/html; charset=utf-8", ".css": "text/css", ".js": "text/javascript", ".svg": "image/svg+xml"}
API_PATHS = ("/v1/chat/completions", "/v1/completions", "/v1/messages")


class SchemaBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str | None = None
    pml: str | None = None


class PromptBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    pml: str | None = None
    messages: list[Message] | None = None
    recompute: float | str | None = None
    max_tokens: int = 64


@dataclass
class StudioContext:
    """What the studio needs from the app. ``namespace(request)`` checks the key (the app's);
    ``prep``: the thread tokenizing and laying out runs on (never the event loop); ``tenants``: the
    app maps keys to namespaces (False: one namespace, whose every pool entry the cache view may show)."""

    pc: PromptCache
    preparer: Preparer
    backend: Backend
    lifecycle: Lifecycle
    namespace: Callable[[Request], str]
    prep: PrepThread
    model_name: str
    tenants: bool


def add_studio_routes(app: FastAPI, ctx: StudioContext) -> None:
    """The studio on ``app``: the page, its files and its JSON API."""
    studio = Studio(ctx)
    app.add_middleware(TrafficTap, traffic=studio.traffic, namespace=ctx.namespace)

    @app.get("/", include_in_schema=False)
    async def root():
        return RedirectResponse("/studio")

    @app.get("/studio", include_in_schema=False)
    async def page():
        return HTMLResponse((STATIC / "index.html").read_text(encoding="utf-8"))

    @app.get("/studio/static/{name}", include_in_schema=False)
    async def static(name: str):
        f = STATIC / name
        if "/" in name or Path(name).suffix not in TYPES or not f.is_file():
            raise APIError(404, f"no studio file '{name}'")
        return Response(f.read_bytes(), media_type=TYPES[Path(name).suffix])

    @app.get("/studio/api/info")
    async def info(request: Request):
        return studio.info(ctx.namespace(request), getattr(app.state, "studio_sources", {}))

    app.post("/studio/api/schema")(studio.schema)
    app.post("/studio/api/prompt")(studio.prompt)
    app.post("/studio/api/full")(studio.full)
    app.get("/studio/api/cache")(studio.cache)


class Studio:
    """The JSON API's views, over one app's engine."""

    def __init__(self, ctx: StudioContext):
        self.ctx, self.pc, self.preparer = ctx, ctx.pc, ctx.preparer
        self.prefix = ctx.backend.prefix
        self.traffic = Traffic()
        self.no_files = tempfile.mkdtemp(prefix="promptcache-studio-")  # src= of posted schemas resolves in here: nothing

    def info(self, ns: str, sources: dict[str, str]) -> dict:
        names = self.pc.registry.names(ns)
        return {"model": self.ctx.model_name, "namespace": ns, "schemas": names,
                "block_size": self.prefix.block_size, "pool": True, "context": self.preparer.context,
                "sources": {n: t for n, t in sources.items() if n in names}}  # PML texts to edit (``promptcache studio``)

    async def schema(self, request: Request):
        return await self.ctx.prep.respond(self.schema_view, request, self.ctx.namespace(request))

    def schema_view(self, request: Request, ns: str) -> Response | dict:
        """On the prep thread (validating, laying out and rendering a large schema take seconds)."""
        body = parse(request, SchemaBody)
        if (body.name is None) == (body.pml is None):
            raise APIError(400, "send either 'name' (a loaded schema) or 'pml' (schema text)", "pml")
        if body.name is not None:
            try:
                layout = self.pc.schema(body.name, ns).layout
            except PMLError as e:
                raise APIError(404, str(e), "name") from None
        else:
            if len(body.pml) > self.preparer.max_chars:
                raise APIError(400, f"pml holds {len(body.pml)} characters, the limit is {self.preparer.max_chars}",
                               "pml")
            try:
                layout = layout_schema(body.pml, self.pc.tok, max_positions=self.preparer.context,
                                       allow_src_root=self.no_files)
            except PMLError as e:
                return _pml_error(e)
        return studio_views.schema_view(layout, self.pc.tokenizer)

    async def prompt(self, request: Request):
        return await self.ctx.prep.respond(self.posted_prompt_view, request, self.ctx.namespace(request))

    def posted_prompt_view(self, request: Request, ns: str) -> Response | dict:
        body = _check_prompt(parse(request, PromptBody), self.preparer.max_chars)
        view = self.prompt_view(body, ns)
        if "error" in view:
            return JSONResponse(APIError(400, view["error"]["message"], "pml").body() | view, status_code=400)
        return view

    def prompt_view(self, body: PromptBody, ns: str) -> dict:
        view = self._pml_view(body, ns) if body.pml is not None else self._chat_view(body, ns)
        if "error" not in view:
            view["cached_tokens"] = sum(s["tokens"] for s in view["spans"] if s["kind"] == "cached")
            view["new_tokens"] = sum(s["tokens"] for s in view["spans"] if s["kind"] != "cached")
        return view

    def _where(self, key: str, absent: str) -> str:
        return "pool" if key in self.ctx.backend.pool else (self.pc.store.tier_of(key) or absent)

    def _pml_view(self, body: PromptBody, ns: str) -> dict:
        pc = self.pc
        try:
            tree = parse_prompt(body.pml)
            entry = pc.schema(tree.schema, ns) if tree.schema is not None else None
            layout = layout_prompt(tree, entry.layout if entry else None, pc.tok, max_positions=self.preparer.context)
        except PMLError as e:
            return {"error": _pml_fields(e)}
        view = studio_views.prompt_view(layout, pc.tokenizer, lambda i: self._where(entry.keys[i], "missing"))
        why = studio_views.why_not_exact(layout, entry.contexts) if entry else None
        r = pc.recompute_fraction(body.recompute)
        if why is not None and entry is not None:  # cached tokens past the exact head may be recomputed
            head = leading_exact(layout, entry)
            drifted = sum(s["tokens"] for s in view["spans"] if s["kind"] == "cached") - head
            studio_views.mark_drifted(view, layout, head, "recomputed" if r >= 1.0 else "drifted")
            view["recompute"] = {"fraction": r, "drifted_tokens": drifted, "budget": round(r * drifted)}
        if entry is not None:
            self.traffic.attribute(ns, {entry.keys[s.schema_index]: f"{entry.name}: {s.name}" for s in layout.cached})
        view.update(exact=why is None, why=why, schema=tree.schema)
        return view

    def _chat_view(self, body: PromptBody, ns: str) -> dict:
        ids = self.preparer.chat_ids(self.preparer.chat_messages(body.messages))
        keys, block = self.prefix.keys(ids, ns), self.prefix.block_size
        self.traffic.attribute(ns, _labels(keys, ids, block, self.pc.tokenizer))
        view = studio_views.chain_view(ids, keys, block, self.pc.tokenizer, lambda k: self._where(k, "computed"))
        view.update(exact=True, why=None, schema=None)
        return view

    async def full(self, request: Request):
        """The baseline beside the cached answer: every token runs, nothing reused or shared."""
        ns = self.ctx.namespace(request)
        body, ids = await self.ctx.prep.run(self._token_ids, request, ns)
        context = self.preparer.context
        if context is not None and len(ids) + body.max_tokens > context:
            raise APIError(400, f"{len(ids)} prompt tokens + max_tokens {body.max_tokens} exceed the context "
                                f"of {context}", "max_tokens")
        sub = Submission(TokenPrompt(tuple(ids), ns), len(ids),
                         SamplingParams(max_new_tokens=body.max_tokens, temperature=0.0))
        return await self.ctx.lifecycle.serve(request, FullRun(sub))

    def _token_ids(self, request: Request, ns: str) -> tuple[PromptBody, list[int]]:
        body = _check_prompt(parse(request, PromptBody), self.preparer.max_chars)
        if body.messages is not None:
            return body, self.preparer.chat_ids(self.preparer.chat_messages(body.messages))
        try:
            return body, self.pc.layout(parse_prompt(body.pml), ns).token_ids
        except PMLError as e:
            raise APIError(400, f"bad PML prompt: {e}", "pml") from None

    async def cache(self, request: Request):
        return await self.ctx.prep.respond(self.cache_view, self.ctx.namespace(request))

    def cache_view(self, ns: str) -> dict:
        pc, prefix, traffic = self.pc, self.prefix, self.traffic
        for body in traffic.pending(ns):  # recent plain requests: their prefix keys, derived once
            ids = _body_ids(body, self.preparer, pc.tokenizer)
            if ids:
                traffic.attribute(ns, _labels(prefix.keys(ids, ns), ids, prefix.block_size, pc.tokenizer))
        own = traffic.attributed(ns)
        modules = []
        for name in pc.registry.names(ns):
            entry = pc.schema(name, ns)
            for i, key in entry.keys.items():
                own[key] = f"{name}: {entry.layout.spans[i].name}"
                modules.append({"label": own[key], "tokens": len(entry.layout.spans[i].token_ids),
                                "where": self._where(key, "missing")})
        out = {"namespace": ns, "time": time.time(), "tiers": pc.store.describe(),
               "pins": _pins(pc.store.pins), "series": traffic.series(ns), "totals": traffic.total(ns),
               "modules": modules}
        snap = self.ctx.backend.pool.describe()
        codes, mine = studio_cache.blocks(snap, own, all_own=not self.ctx.tenants)
        out["pool"] = {"block_size": snap["block_size"], "codes": codes, "counts": studio_cache.summary(codes),
                       "entries": mine, "evictions": snap["evictions"]}
        return out


class TrafficTap:
    """ASGI middleware: after each API answer, its counts (the access log's ``note``s) go to
    ``Traffic`` under the caller's namespace, with the body of a plain chat or completion
    request (its prefix blocks are attributed to that namespace when a cache view asks)."""

    def __init__(self, app, traffic: Traffic, namespace):
        self.app, self.traffic, self.namespace = app, traffic, namespace

    async def __call__(self, scope, receive, send):
        await self.app(scope, receive, send)
        if scope["type"] != "http" or scope["path"] not in API_PATHS:
            return
        noted = scope.get("state", {}).get("access", {})
        if "prompt" not in noted:  # refused or failed before it ran
            return
        try:
            ns = self.namespace(Request(scope))
        except APIError:
            return
        body = scope.get(SCOPE_KEY)
        plain = isinstance(body, dict) and scope["path"] != "/v1/messages" and not body.get("pml") \
            and not body.get("documents") and not body.get("tools")
        self.traffic.record(ns, noted["prompt"], noted.get("cached", 0), noted.get("ttft"),
                            body if plain else None, noted.get("recomputed", 0))


class FullRun(Exchange):
    """The baseline run, always streamed: ``prefilled`` (TTFT, prompt tokens), ``text`` pieces,
    ``done`` (completion tokens) or ``error``, one JSON object per SSE event."""

    stream = True

    def __init__(self, sub: Submission):
        self.submission = sub

    def sink(self, result: PrefillResult) -> EventSink:
        return FullRunStream(self.submission.prompt_tokens)


class FullRunStream(EventSink):
    def __init__(self, prompt_tokens: int):
        self.prompt_tokens = prompt_tokens

    def prefilled(self, result: PrefillResult):
        return [sse({"type": "prefilled", "ttft_ms": result.ttft * 1e3, "prompt_tokens": self.prompt_tokens,
                        "cached_tokens": TokenCounts.of(result).cached})]

    def text(self, piece: str):
        return [sse({"type": "text", "text": piece})]

    def done(self, generation: Generation):
        return [sse({"type": "done", "completion_tokens": len(generation.token_ids)})]

    def failed(self, error: BaseException):
        return [sse({"type": "error", "message": str(error)})]

    def cancelled(self):
        return [sse({"type": "error", "message": "the run was cancelled"})]


def _check_prompt(body: PromptBody, max_chars: int) -> PromptBody:
    """One of pml / messages, within the preparer's character limit, and a sane max_tokens."""
    if (body.pml is None) == (body.messages is None):
        raise APIError(400, "send either 'pml' (a PML prompt) or 'messages' (a chat)", "pml")
    if body.messages is not None and not body.messages:
        raise APIError(400, "'messages' must hold at least one message", "messages")
    chars = len(body.pml) if body.pml is not None else sum(len(str(m.content or "")) for m in body.messages)
    if chars > max_chars:
        raise APIError(400, f"the prompt holds {chars} characters, the limit is {max_chars}", "pml")
    if not 1 <= body.max_tokens <= 4096:
        raise APIError(400, f"max_tokens must be in [1, 4096], got {body.max_tokens}", "max_tokens")
    return body


def _pml_fields(e: PMLError) -> dict:
    """The first error's line and reason, and ``errors``: every error of the text (up to
    ``MAX_ERRORS``; ``more`` counts the others), as ``promptcache validate`` prints them."""
    each = e.errors if isinstance(e, PMLErrors) else [e]
    return {"message": str(e), "line": e.line, "reason": e.reason, "source": e.source,
            "errors": [{"line": x.line, "reason": x.reason} for x in each], "more": getattr(e, "more", 0)}


def _pml_error(e: PMLError) -> JSONResponse:
    """400 with the line and reason beside the message (``validate``'s ``source:line: reason``)."""
    body = APIError(400, str(e), "pml").body()
    body["error"].update(_pml_fields(e))
    return JSONResponse(body, status_code=400)


def _labels(keys: list[str], ids: list[int], block: int, tokenizer) -> dict[str, str]:
    """key -> a label for a prefix block: its token range and first words."""
    out = {}
    for i, k in enumerate(keys):
        text = tokenizer.decode(ids[i * block:(i + 1) * block]).replace("\n", " ").strip()
        out[k] = f"prefix tokens [{i * block}, {(i + 1) * block}): {text[:40]}"
    return out


def _body_ids(body: dict, preparer, tokenizer) -> list[int] | None:
    """Token ids a plain chat or completion body was served with (None: not derivable)."""
    try:
        if body.get("messages"):
            msgs = [Message.model_validate(m) for m in body["messages"]]
            return preparer.chat_ids(preparer.chat_messages(msgs))
        p = body.get("prompt")
        if isinstance(p, list) and len(p) == 1 and isinstance(p[0], str):
            p = p[0]
        if isinstance(p, str) and p:
            return tokenizer(p).input_ids
        if isinstance(p, list) and p and all(isinstance(t, int) for t in p):
            return list(p)
    except (APIError, ValidationError, ValueError, TypeError):
        return None
    return None


def _pins(pins) -> dict | None:
    if pins is None:
        return None
    return {"bytes": pins.bytes_pinned, "budget": pins.budget, "keys": len(pins)}
