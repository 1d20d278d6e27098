"""The studio: a web page at ``/studio`` (``/`` redirects there) and the JSON routes it draws from.

    GET  /studio                 the page (static/studio/: HTML, CSS, JS; no build step, no CDN)
    GET  /studio/static/NAME     its files
    GET  /studio/api/info        model, the caller's namespace and schemas, block size, pool or not
    POST /studio/api/schema      {"name": loaded schema} or {"pml": schema text} -> the layout as bars
                                 (studio_views.schema_view); bad PML: 400 with "line" and "reason",
                                 as ``promptcache validate`` reports them
    POST /studio/api/prompt      {"pml": prompt} or {"messages": [...]}, optional "recompute" -> spans
                                 with where their states are, the layout's gaps, ``exact`` or why not
    POST /studio/api/full        the same body plus "max_tokens": an SSE stream of a full prefill's
                                 answer (no stored state), beside the cached one the page streams
                                 from /v1/chat/completions
    GET  /studio/api/cache       the cache view for the caller's namespace (studio_cache.py)

The page itself holds no data and needs no key; every JSON route takes the API's keys (the page
asks for one when a route answers 401) and shows only the key's namespace. A schema posted as
text is laid out with the tokenizer only (never encoded or added) and may not read files:
``src=`` resolves inside an empty folder, so it is refused with its line (DESIGN.md §8: schemas
with files are the operator's). Requests' counts for the hit-rate series are taken by
``TrafficTap`` after each API answer (from what the routes ``note`` for the access log).
"""

from __future__ import annotations

import asyncio
import json
import tempfile
import time
from importlib import resources
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse, RedirectResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, ValidationError

from ..engine import SamplingParams, TokenPrompt
from ..engine.assemble import leading_exact
from ..layout import layout_prompt, layout_schema
from ..pml import PMLError, parse_prompt
from . import studio_cache, studio_views
from .backend import QueueFull
from .limits import SCOPE_KEY, parsed_body
from .protocol import APIError, Message
from .studio_cache import Traffic

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


def _body(request: Request, cls):
    try:
        body = cls.model_validate(parsed_body(request.scope))
    except ValidationError as e:
        err = e.errors()[0]
        raise APIError(400, f"{'.'.join(str(x) for x in err['loc'])}: {err['msg']}") from None
    return body


def add_studio_routes(app: FastAPI, pc, planner, prefix, backend, namespace, planning, model_name: str,
                      tenants: bool) -> None:
    """The studio on ``app``: ``namespace(request)`` checks the key (the app's); ``planning``: the
    executor tokenizing and laying out runs on (never the event loop); ``tenants``: the app maps
    keys to namespaces (False: one namespace, whose every pool entry the cache view may show)."""
    traffic = Traffic()
    no_files = tempfile.mkdtemp(prefix="promptcache-studio-")  # src= of posted schemas resolves in here: nothing
    app.add_middleware(TrafficTap, traffic=traffic, namespace=namespace)

    async def off_loop(fn, *args):
        return await asyncio.get_running_loop().run_in_executor(planning, fn, *args)

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
        ns = namespace(request)
        names = pc.registry.names(ns)
        sources = getattr(app.state, "studio_sources", {})
        return {"model": model_name, "namespace": ns, "schemas": names,
                "block_size": prefix.block_size, "pool": True, "context": planner.context,
                "sources": {n: t for n, t in sources.items() if n in names}}  # PML texts to edit (``promptcache studio``)

    @app.post("/studio/api/schema")
    async def schema(request: Request):
        ns = namespace(request)
        body = _body(request, SchemaBody)
        if (body.name is None) == (body.pml is None):
            raise APIError(400, "send either 'name' (a loaded schema) or 'pml' (schema text)", "pml")
        if body.name is not None:
            try:
                layout = pc.schema(body.name, ns).layout
            except PMLError as e:
                raise APIError(404, str(e), "name") from None
        else:
            if len(body.pml) > planner.max_chars:
                raise APIError(400, f"pml holds {len(body.pml)} characters, the limit is {planner.max_chars}", "pml")
            try:
                layout = await off_loop(lambda: layout_schema(body.pml, pc.tok, max_positions=planner.context,
                                                              allow_src_root=no_files))
            except PMLError as e:
                return _pml_error(e)
        return await off_loop(studio_views.schema_view, layout, pc.tokenizer)

    def prompt_view(body: PromptBody, ns: str) -> dict:
        if body.pml is not None:
            try:
                tree = parse_prompt(body.pml)
                entry = pc.schema(tree.schema, ns) if tree.schema is not None else None
                layout = layout_prompt(tree, entry.layout if entry else None, pc.tok, max_positions=planner.context)
            except PMLError as e:
                return {"error": _pml_fields(e)}
            pool = backend.pool

            def where(i: int) -> str:
                key = entry.keys[i]
                return "pool" if key in pool else (pc.store.tier_of(key) or "missing")

            view = studio_views.prompt_view(layout, pc.tokenizer, where)
            why = studio_views.why_not_exact(layout, entry.contexts) if entry else None
            r = pc.recompute_fraction(body.recompute)
            if why is not None and entry is not None:  # cached tokens past the exact head may be recomputed
                head = leading_exact(layout, entry)
                drifted = sum(s["tokens"] for s in view["spans"] if s["kind"] == "cached") - head
                studio_views.mark_drifted(view, layout, head, "recomputed" if r >= 1.0 else "drifted")
                view["recompute"] = {"fraction": r, "drifted_tokens": drifted, "budget": round(r * drifted)}
            if entry is not None:
                traffic.attribute(ns, {entry.keys[s.schema_index]: f"{entry.name}: {s.name}" for s in layout.cached})
            view.update(exact=why is None, why=why, schema=tree.schema)
        else:
            ids = planner.chat_ids(planner.chat_messages(body.messages))
            keys = prefix.keys(ids, ns)
            traffic.attribute(ns, _labels(keys, ids, prefix.block_size, pc.tokenizer))
            pool = backend.pool
            view = studio_views.chain_view(
                ids, keys, prefix.block_size, pc.tokenizer,
                lambda k: "pool" if k in pool else (pc.store.tier_of(k) or "computed"))
            view.update(exact=True, why=None, schema=None)
        view["cached_tokens"] = sum(s["tokens"] for s in view["spans"] if s["kind"] == "cached")
        view["new_tokens"] = sum(s["tokens"] for s in view["spans"] if s["kind"] != "cached")
        return view

    @app.post("/studio/api/prompt")
    async def prompt(request: Request):
        ns = namespace(request)
        body = _check_prompt(_body(request, PromptBody), planner.max_chars)
        view = await off_loop(prompt_view, body, ns)
        if "error" in view:
            return JSONResponse(APIError(400, view["error"]["message"], "pml").body() | view, status_code=400)
        return view

    @app.post("/studio/api/full")
    async def full(request: Request):
        ns = namespace(request)
        body = _check_prompt(_body(request, PromptBody), planner.max_chars)

        def token_ids() -> list[int]:
            if body.messages is not None:
                return planner.chat_ids(planner.chat_messages(body.messages))
            try:
                return pc.layout(parse_prompt(body.pml), ns).token_ids
            except PMLError as e:
                raise APIError(400, f"bad PML prompt: {e}", "pml") from None

        ids = await off_loop(token_ids)
        if planner.context is not None and len(ids) + body.max_tokens > planner.context:
            raise APIError(400, f"{len(ids)} prompt tokens + max_tokens {body.max_tokens} exceed the context "
                                f"of {planner.context}", "max_tokens")
        n = len(ids)
        try:  # the baseline: every token runs, nothing reused or shared
            job = backend.submit(TokenPrompt(pc, tuple(ids), ns), SamplingParams(max_new_tokens=body.max_tokens,
                                                                                 temperature=0.0))
        except QueueFull as e:
            raise APIError(503, f"the server is busy: {e}; retry later") from None
        return StreamingResponse(_full_events(job, backend, n), media_type="text/event-stream")

    @app.get("/studio/api/cache")
    async def cache(request: Request):
        ns = namespace(request)
        return await off_loop(cache_view, ns)

    def cache_view(ns: str) -> dict:
        for body in traffic.pending(ns):  # recent plain requests: their prefix keys, derived once
            ids = _body_ids(body, planner, pc.tokenizer)
            if ids:
                traffic.attribute(ns, _labels(prefix.keys(ids, ns), ids, prefix.block_size, pc.tokenizer))
        own = traffic.attributed(ns)
        modules = []
        for name in pc.registry.names(ns):
            entry = pc.schema(name, ns)
            for i, key in entry.keys.items():
                own[key] = f"{name}: {entry.layout.spans[i].name}"
                modules.append({"label": own[key], "tokens": len(entry.layout.spans[i].token_ids),
                                "where": "pool" if key in backend.pool
                                else (pc.store.tier_of(key) or "missing")})
        out = {"namespace": ns, "time": time.time(), "tiers": pc.store.describe(),
               "pins": _pins(pc.store.pins), "series": traffic.series(ns), "totals": traffic.total(ns),
               "modules": modules}
        snap = backend.pool.describe()  # every model runs on the pool
        codes, mine = studio_cache.blocks(snap, own, all_own=not tenants)
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
                            body if plain else None)


async def _full_events(job, backend, n: int):
    def event(obj) -> str:
        return f"data: {json.dumps(obj)}\n\n"

    done = False
    try:
        while True:
            kind, value = await job.events.get()
            if kind == "prefilled":
                yield event({"type": "prefilled", "ttft_ms": value.ttft * 1e3, "prompt_tokens": n, "cached_tokens": 0})
            elif kind == "text":
                yield event({"type": "text", "text": value})
            elif kind == "done":
                done = True
                yield event({"type": "done", "completion_tokens": len(value.token_ids)})
                return
            elif kind == "error":
                done = True
                yield event({"type": "error", "message": str(value)})
                return
    finally:
        if not done:
            backend.cancel(job)


def _check_prompt(body: PromptBody, max_chars: int) -> PromptBody:
    """One of pml / messages, within the planner's character limit, and a sane max_tokens."""
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
    return {"message": str(e), "line": e.line, "reason": e.reason, "source": e.source}


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


def _body_ids(body: dict, planner, tokenizer) -> list[int] | None:
    """Token ids a plain chat or completion body was served with (None: not derivable)."""
    try:
        if body.get("messages"):
            msgs = [Message.model_validate(m) for m in body["messages"]]
            return planner.chat_ids(planner.chat_messages(msgs))
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
