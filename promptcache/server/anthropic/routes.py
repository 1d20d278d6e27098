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

Tools: ``tools.py`` (checked before rendering; an answer of a request with tools is
parsed into ``tool_use`` blocks, and streamed as content blocks opened as text and calls come).

``POST /v1/messages/count_tokens`` answers ``{"input_tokens": N}``: the tokens the same request's
prompt renders to (``messages.count_tokens`` of the client), checked as ``/v1/messages`` checks it.

Keys: the ``x-api-key`` header (what the ``anthropic`` client sends) or ``Authorization: Bearer``.

The route parses, renders and pins here, then hands a ``MessagesExchange`` to the same lifecycle
the OpenAI routes use (``core/lifecycle.py``: submit, await the prefill, count, stream or
collect); this module renders the answer as a ``message`` or as the API's event sequence. Errors
are answered in the API's shape (``AnthropicError.of``).
"""


from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import ValidationError

from ...engine import PromptCache, SamplingParams, TokenPrompt
from ...engine.serving_core.prefix import PrefixCache
from ...engine.prefill.results import Generation, PrefillResult
from ...store import PinBudgetError, Pins
from ..core.counts import TokenCounts
from ..core.errors import APIError
from ..core.events import EventSink
from ..core.lifecycle import Exchange, Lifecycle, Submission, engine_failed
from ..core.limits import parsed_body
from ..openai.prepare import PrepThread
from ..openai.toolcalls import parse as parse_calls
from . import protocol as A
from . import tools as anthropic_tools
from .prompt import RenderedPrompt, render


@dataclass
class MessagesContext:
    """What the routes need from the app."""

    pc: PromptCache
    lifecycle: Lifecycle
    prep: PrepThread  # rendering and tokenizing run there, never on the event loop
    prefix: PrefixCache  # the engine's automatic prefix cache: the blocks a breakpoint pins
    pins: Pins
    namespace: Callable[[Request], str]  # raises APIError 401 for a bad key
    model_name: str
    context: int | None  # tokens a prompt plus its answer may use (None: unbounded)


def add_messages_route(app: FastAPI, ctx: MessagesContext) -> None:
    block_bytes = ctx.prefix.block_size * ctx.pc.runner.stored_spec.bytes_per_token

    @app.post("/v1/messages")
    async def messages(request: Request):
        try:
            ns = ctx.namespace(request)
            req, sub = await ctx.prep.run(_prepare, ctx, request, ns, block_bytes)
            return await ctx.lifecycle.serve(request, MessagesExchange(req, sub, ctx.pc.tokenizer,
                                                                       ctx.prefix.block_size))
        except APIError as e:
            raise A.AnthropicError.of(e) from None

    @app.post("/v1/messages/count_tokens")
    async def count_tokens(request: Request):
        """``{"input_tokens": N}``: the prompt's tokens as /v1/messages would render them."""
        try:
            ctx.namespace(request)
            prompt = await ctx.prep.run(_counted, ctx, request)
        except APIError as e:
            raise A.AnthropicError.of(e) from None
        return {"input_tokens": len(prompt.ids)}


def _render(ctx: MessagesContext, req: A.MessagesRequest) -> RenderedPrompt:
    anthropic_tools.check(req, ctx.pc.tokenizer)
    return render(ctx.pc.tokenizer, req)


def _counted(ctx: MessagesContext, request: Request) -> RenderedPrompt:
    """A count_tokens request's prompt; on the prep thread."""
    return _render(ctx, _parse(request, ctx.model_name, A.CountTokensRequest).as_request())


def _prepare(ctx: MessagesContext, request: Request, ns: str,
             block_bytes: int) -> tuple[A.MessagesRequest, Submission]:
    """The request and what to submit (checked against the context), its breakpoints pinned; on
    the prep thread (validating, rendering, tokenizing and hashing a 2 MB prompt take seconds)."""
    req = _parse(request, ctx.model_name)
    prompt = _render(ctx, req)
    params = _sampling(req, len(prompt.ids), ctx.context)
    sub = Submission(TokenPrompt(tuple(prompt.ids), ns, reuse=True), len(prompt.ids), params,
                     anthropic_tools.processors(req, ctx.pc))
    _pin(ctx, prompt, ns, block_bytes)
    return req, sub


def _parse(request: Request, model_name: str, kind: type = A.MessagesRequest):
    """The request body (parsed once, by ``limits.RequestGuard``) as ``kind`` (``MessagesRequest``
    or ``CountTokensRequest``); 400 naming the field."""
    try:
        req = kind.model_validate(parsed_body(request.scope))
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



class MessagesExchange(Exchange):
    """A Messages request, rendered in the API's shapes. ``usage``: ``cache_read_input_tokens`` are the
    prompt tokens served from stored blocks, ``cache_creation_input_tokens`` the full blocks past
    them that this request stored (it shares every full block it computes), ``input_tokens`` the rest."""

    def __init__(self, req: A.MessagesRequest, sub: Submission, tokenizer, block_size: int):
        self.req, self.submission, self.tokenizer, self.block_size = req, sub, tokenizer, block_size
        self.stream, self.tools = bool(req.stream), anthropic_tools.active(req)
        self.mid = A.new_message_id()

    def usage(self, result: PrefillResult, output_tokens: int) -> dict:
        counts = TokenCounts.of(result)  # recomputed tokens were not read from the cache
        n, read = counts.prompt, counts.cached
        made = max(0, min(n // self.block_size * self.block_size - read, n - read))
        return A.usage(n - read - made, made, read, output_tokens)

    def finish(self, result: PrefillResult, gen: Generation, called: bool = False) -> tuple[str, str | None, dict]:
        """The stop reason, the stop sequence that ended the answer (if one did) and the usage."""
        matched = _matched_stop(self.tokenizer, gen, self.req.stop_sequences or [])
        return (A.stop_reason(gen.finish_reason, matched, called), matched,
                self.usage(result, len(gen.token_ids)))

    def answer(self, result: PrefillResult, text: str, generation: Generation) -> JSONResponse:
        if not self.tools:
            reason, matched, use = self.finish(result, generation)
            return JSONResponse(A.message(self.mid, self.req.model, text, reason, matched, use))
        content, calls = parse_calls(text)
        reason, matched, use = self.finish(result, generation, bool(calls))
        return JSONResponse(A.message(self.mid, self.req.model, content, reason, matched, use,
                                      [anthropic_tools.tool_use(c) for c in calls]))

    def sink(self, result: PrefillResult) -> EventSink:
        return MessagesStream(self, result)


class MessagesStream(EventSink):
    """The API's event sequence for one streamed answer; with tools, content blocks open as text
    and calls come (``anthropic_tools.ToolEvents``)."""

    def __init__(self, ex: MessagesExchange, result: PrefillResult):
        self.ex, self.result = ex, result
        self.blocks = anthropic_tools.ToolEvents() if ex.tools else None

    def prefilled(self, result: PrefillResult):
        return A.start_events(self.ex.mid, self.ex.req.model, self.ex.usage(result, 0), text_block=self.blocks is None)

    def text(self, piece: str):
        return self.blocks.feed(piece) if self.blocks is not None else [A.delta_event(piece)]

    def done(self, generation: Generation):
        if self.blocks is None:
            reason, matched, use = self.ex.finish(self.result, generation)
            return A.end_events(reason, matched, {"output_tokens": use["output_tokens"]})
        out = self.blocks.close()
        reason, matched, use = self.ex.finish(self.result, generation, bool(self.blocks.calls.calls))
        return out + A.end_events(reason, matched, {"output_tokens": use["output_tokens"]}, text_block=False)

    def failed(self, error: BaseException):
        return [A.error_event(engine_failed(error))]

    def cancelled(self):
        return [A.error_event(APIError(500, "the request was cancelled (its reader fell behind, or the server "
                                            "is shutting down)"))]

def _matched_stop(tok, gen, stops: list[str]) -> str | None:
    """The stop sequence that ended ``gen``, if one did (the text is cut before it)."""
    if gen.finish_reason != "stop" or not stops:
        return None
    full = tok.decode(gen.token_ids, skip_special_tokens=True)
    return next((s for s in stops if s and full.startswith(gen.text + s)), None)
