"""``POST /v1/messages``: Anthropic's Messages API over the engine, with ``cache_control`` pins.

A request is rendered (``anthropic_prompt.render``) and served through the automatic prefix
cache (``prefix.PrefixCache``) like a plain chat request: every full block of every prompt is
stored, as OpenAI-style automatic caching does. A ``cache_control`` breakpoint additionally pins
the prefix's full blocks up to it (``store.Pins``) for its TTL ("5m": 300 s, "1h": 3600 s), so
memory pressure does not evict them while the pin lives; pins count against the pin budget and a
request that would pass it is refused (400 naming ``cache_control``) before anything runs.
Breakpoints work at block granularity: the tokens after a breakpoint's last full block are not
pinned (as the hosted API does not cache below its minimum length).

``usage``: ``cache_read_input_tokens`` are the prompt tokens served from stored blocks,
``cache_creation_input_tokens`` the tokens of the full blocks past those that this request
stored, ``input_tokens`` the rest (so the three add up to the prompt, as in the API).

Tools: ``anthropic_tools.py`` (checked before rendering; an answer of a request with tools is
parsed into ``tool_use`` blocks, and streamed as content blocks opened as text and calls come).

``POST /v1/messages/count_tokens`` answers ``{"input_tokens": N}``: the tokens the same request's
prompt renders to (``messages.count_tokens`` of the client), checked as ``/v1/messages`` checks it.

Keys: the ``x-api-key`` header (what the ``anthropic`` client sends) or ``Authorization: Bearer``.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Callable

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError

from ..store import PinBudgetError, Pins
from . import anthropic_protocol as A
from . import anthropic_tools
from .access import note
from .anthropic_prompt import RenderedPrompt, render
from ..engine import SamplingParams, TokenPrompt
from .backend import QueueFull
from .protocol import APIError
from .toolcalls import parse as parse_calls

DISCONNECT_POLL_S = 1.0  # a non-streaming request checks this often whether its client is still there


@dataclass
class MessagesContext:
    """What the route needs from the app: the engine, its worker, the prefix cache, pins."""

    pc: object
    backend: object
    prefix: object
    metrics: object
    pins: Pins
    namespace: Callable[[Request], str]  # raises APIError 401 for a bad key
    model_name: str
    context: int | None  # tokens a prompt plus its answer may use (None: unbounded)


def add_messages_route(app: FastAPI, ctx: MessagesContext) -> None:
    context = ctx.context
    block_bytes = ctx.prefix.block_size * ctx.pc.runner.stored_spec.bytes_per_token

    @app.post("/v1/messages")
    async def messages(request: Request):
        try:
            ns = ctx.namespace(request)
            req = await _parse(request, ctx.model_name)
            anthropic_tools.check(req, ctx.pc.tokenizer)
            prompt = render(ctx.pc.tokenizer, req)
            params = _sampling(req, len(prompt.ids), context)
            constraints = anthropic_tools.processors(req, ctx.pc)
            _pin(ctx, prompt, ns, block_bytes)
        except APIError as e:
            raise A.AnthropicError.of(e) from None
        return await _serve(request, ctx, req, prompt, ns, params, constraints)

    @app.post("/v1/messages/count_tokens")
    async def count_tokens(request: Request):
        """``{"input_tokens": N}``: the prompt's tokens as /v1/messages would render them."""
        try:
            ctx.namespace(request)
            req = (await _parse(request, ctx.model_name, A.CountTokensRequest)).as_request()
            anthropic_tools.check(req, ctx.pc.tokenizer)
            prompt = render(ctx.pc.tokenizer, req)
        except APIError as e:
            raise A.AnthropicError.of(e) from None
        return {"input_tokens": len(prompt.ids)}


async def _parse(request: Request, model_name: str, kind: type = A.MessagesRequest):
    """The request body as ``kind`` (``MessagesRequest`` or ``CountTokensRequest``); 400 naming the field."""
    try:
        body = await request.json()
    except ValueError:
        raise A.AnthropicError(400, "the request body is not valid JSON") from None
    try:
        req = kind.model_validate(body)
    except ValidationError as e:
        raise A.invalid(e) from None
    if req.model != model_name:
        raise A.AnthropicError(404, f"model '{req.model}' does not exist (this server serves '{model_name}')", "model")
    return req


def _sampling(req: A.MessagesRequest, length: int, context: int | None) -> SamplingParams:
    if context is not None and length + req.max_tokens > context:
        raise A.AnthropicError(400, f"the prompt is {length} tokens and max_tokens is {req.max_tokens}: "
                                    f"{length + req.max_tokens} is past the model's context of {context}",
                               "max_tokens")
    try:
        return SamplingParams(max_new_tokens=req.max_tokens, temperature=req.temperature, top_p=req.top_p,
                              stop=tuple(req.stop_sequences or ()))
    except ValueError as e:  # settings the engine refuses (SamplingParams names the field)
        raise A.AnthropicError(400, str(e)) from None


def _pin(ctx: MessagesContext, prompt: RenderedPrompt, ns: str, block_bytes: int) -> None:
    """Pin each breakpoint's full blocks for its TTL (a block under two breakpoints: the longer)."""
    keys: dict[str, tuple[int, float]] = {}
    for bp in prompt.breakpoints:
        for key in ctx.prefix.keys(prompt.ids[: bp.tokens], ns):
            keys[key] = (block_bytes, max(bp.ttl, keys.get(key, (0, 0.0))[1]))
    if not keys:
        return
    try:
        ctx.pins.pin(keys)
    except PinBudgetError as e:
        where = prompt.breakpoints[-1].where
        raise A.AnthropicError(400, f"cache_control: {e}; wait for pins to expire or pin a shorter prefix",
                               f"{where}.cache_control") from None


async def _serve(request: Request, ctx: MessagesContext, req: A.MessagesRequest, prompt: RenderedPrompt,
                 ns: str, params: SamplingParams, constraints: tuple):
    try:
        job = ctx.backend.submit(TokenPrompt(ctx.pc, tuple(prompt.ids), ns, ctx.prefix), params, constraints)
    except QueueFull as e:
        raise A.AnthropicError(503, f"the server is busy: {e}; retry later") from None
    try:
        kind, res = await job.events.get()  # the prompt ran (or failed) before any answer starts
    except asyncio.CancelledError:
        ctx.backend.cancel(job)
        raise
    if kind == "error":
        raise A.AnthropicError(500, f"the engine failed: {res}")
    n, read = len(prompt.ids), res.cached_tokens
    # every full block it did not read, it shares as it computes it
    made = max(0, min(n // ctx.prefix.block_size * ctx.prefix.block_size - read, n - read))
    m = ctx.metrics
    m.ttft.observe(time.perf_counter() - job.submitted)
    note(request, prompt=n, cached=read, ttft=time.perf_counter() - job.submitted)
    m.prompt_tokens.inc(n)
    m.cached_tokens.inc(read)
    m.requests.labels(request.url.path, "200").inc()
    mid = A.new_message_id()

    def finish(gen, called: bool = False) -> tuple[str, str | None, dict]:
        m.generated_tokens.inc(len(gen.token_ids))
        note(request, generated=len(gen.token_ids))
        matched = _matched_stop(ctx.pc.tokenizer, gen, req.stop_sequences or [])
        return A.stop_reason(gen.finish_reason, matched, called), matched, A.usage(n - read - made, made, read,
                                                                                    len(gen.token_ids))

    tools = anthropic_tools.active(req)
    if req.stream:
        start_use = A.usage(n - read - made, made, read, 0)
        events = anthropic_tools.ToolEvents() if tools else None
        return StreamingResponse(_events(job, ctx.backend, mid, req.model, start_use, finish, events),
                                 media_type="text/event-stream")
    return await _collect(request, job, ctx.backend, mid, req.model, finish, tools)


async def _collect(request: Request, job, backend, mid: str, model: str, finish, tools: bool):
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
            if kind == "text":
                text.append(value)
            elif kind == "done" and tools:
                content, calls = parse_calls("".join(text))
                reason, matched, use = finish(value, bool(calls))
                return JSONResponse(A.message(mid, model, content, reason, matched, use,
                                              [anthropic_tools.tool_use(c) for c in calls]))
            elif kind == "done":
                reason, matched, use = finish(value)
                return JSONResponse(A.message(mid, model, "".join(text), reason, matched, use))
            elif kind is not None:
                raise A.AnthropicError(500, f"the engine failed: {value}")
    except asyncio.CancelledError:
        backend.cancel(job)
        raise


async def _events(job, backend, mid: str, model: str, start_use: dict, finish,
                  tools: anthropic_tools.ToolEvents | None = None):
    """The API's event sequence; a client that goes away cancels the job. ``tools``: the answer
    may call tools (content blocks open as text and calls come)."""
    done = False
    try:
        for e in A.start_events(mid, model, start_use, text_block=tools is None):
            yield e
        while True:
            kind, value = await job.events.get()
            if kind == "text" and tools is not None:
                for e in tools.feed(value):
                    yield e
            elif kind == "text":
                yield A.delta_event(value)
            elif kind == "done" and tools is not None:
                done = True
                for e in tools.close():
                    yield e
                reason, matched, use = finish(value, bool(tools.calls.calls))
                for e in A.end_events(reason, matched, {"output_tokens": use["output_tokens"]}, text_block=False):
                    yield e
                return
            elif kind == "done":
                done = True
                reason, matched, use = finish(value)
                for e in A.end_events(reason, matched, {"output_tokens": use["output_tokens"]}):
                    yield e
                return
            else:
                done = True
                yield A.error_event(APIError(500, f"the engine failed: {value}"))
                return
    finally:
        if not done:
            backend.cancel(job)


def _matched_stop(tok, gen, stops: list[str]) -> str | None:
    """The stop sequence that ended ``gen``, if one did (the text is cut before it)."""
    if gen.finish_reason != "stop" or not stops:
        return None
    full = tok.decode(gen.token_ids, skip_special_tokens=True)
    return next((s for s in stops if s and full.startswith(gen.text + s)), None)
