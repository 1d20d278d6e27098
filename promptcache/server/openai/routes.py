"""POST /v1/chat/completions and /v1/completions (parse, prepare, ``Lifecycle.serve``, render); GET /v1/models.

The route validates the body (``protocol.parse``) and prepares it (``Preparer``: a
``Submission``), both on the prep thread, never the event loop, and hands an ``OpenAIExchange``
to the lifecycle, which submits it, awaits its prefill and streams or collects (``core/lifecycle.py``). This module only renders: a collected
answer as ``chat.completion`` / ``text_completion``, a streamed one as SSE chunks.

Streaming: a chat stream opens with the assistant role chunk. Token log-probabilities ride on the
next text chunk (text held back for a stop string, or as a possible tool call, lags its tokens),
the rest on the finishing chunk; with ``stream_options.include_usage`` a usage chunk follows it,
then ``[DONE]``. A request with tools has its answer parsed for tool calls (``toolcalls.py``; each
call sent whole, once its block closes).
"""

from __future__ import annotations

from typing import Callable

from fastapi import FastAPI, Request

from ...engine.prefill.results import Generation, PrefillResult, TokenLogprob
from ..core.counts import TokenCounts
from ..core.errors import APIError
from ..core.events import EventSink
from ..core.lifecycle import Exchange, Lifecycle, Submission, engine_failed, sse
from . import fields, tools
from . import protocol as P
from .prepare import Preparer, PrepThread
from .toolcalls import CallStream, finish_reason, openai_deltas, parse as parse_calls


def add_openai_routes(app: FastAPI, lifecycle: Lifecycle, preparer: Preparer, prep: PrepThread,
                      namespace: Callable[[Request], str], model_name: str) -> None:
    """``namespace(request)``: the key check (APIError 401)."""
    tokenizer = preparer.pc.tokenizer

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        ns = namespace(request)
        req = await prep.run(P.parse, request, P.ChatRequest, model_name)
        sub = await prep.prepare(preparer.chat, req, ns)
        return await lifecycle.serve(request, OpenAIExchange(req, sub, tokenizer, chat=True,
                                                             tool_calls=tools.active(req)))

    @app.post("/v1/completions")
    async def completions(request: Request):
        ns = namespace(request)
        req = await prep.run(P.parse, request, P.CompletionRequest, model_name)
        sub = await prep.prepare(preparer.completion, req, ns)
        return await lifecycle.serve(request, OpenAIExchange(req, sub, tokenizer, chat=False))

    @app.get("/v1/models")
    async def models(request: Request):
        namespace(request)
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": 0,
                                            "owned_by": "promptcache"}]}


class OpenAIExchange(Exchange):
    """A chat (``chat``) or completion request, rendered in OpenAI's shapes."""

    def __init__(self, req: P.BaseRequest, sub: Submission, tokenizer, chat: bool, tool_calls: bool = False):
        self.req, self.submission, self.tokenizer, self.chat, self.tool_calls = req, sub, tokenizer, chat, tool_calls
        self.stream = bool(req.stream)
        self.rid = P.new_id("chatcmpl" if chat else "cmpl")

    def usage(self, result: PrefillResult, gen: Generation) -> dict:
        counts = TokenCounts.of(result)
        return P.usage(counts.prompt, len(gen.token_ids), counts.cached, result.exact, counts.recomputed)

    def logprobs(self, entries: list[TokenLogprob] | None, start: int = 0) -> dict | None:
        """``choices[].logprobs`` (None: not asked); ``start``: a completion's text offset of the first."""
        if self.chat:
            return fields.chat_logprobs(self.tokenizer, entries)
        return fields.completion_logprobs(self.tokenizer, entries, start)

    def answer(self, result: PrefillResult, text: str, generation: Generation) -> dict:
        use, lp, model = self.usage(result, generation), self.logprobs(generation.logprobs), self.req.model
        if self.tool_calls:
            content, calls = parse_calls(text)
            return P.chat_response(self.rid, model, content, finish_reason(generation.finish_reason, calls), use, lp,
                                   [c.openai() for c in calls])
        make = P.chat_response if self.chat else P.completion_response
        return make(self.rid, model, text, generation.finish_reason, use, lp)

    def sink(self, result: PrefillResult) -> EventSink:
        return OpenAIStream(self, result)


class OpenAIStream(EventSink):
    """One streamed answer's SSE chunks."""

    def __init__(self, ex: OpenAIExchange, result: PrefillResult):
        self.ex, self.result = ex, result
        self.pending: list[TokenLogprob] = []  # log-probabilities not sent yet
        self.sent = 0  # text characters sent
        self.calls = CallStream() if ex.tool_calls else None
        opts = ex.req.stream_options
        self.include_usage = bool(opts and opts.include_usage)

    def prefilled(self, result: PrefillResult):
        return [sse(P.chat_chunk(self.ex.rid, self.ex.req.model, {"role": "assistant", "content": ""}))] \
            if self.ex.chat else []

    def logprob(self, entry: TokenLogprob):
        self.pending.append(entry)
        return ()

    def text(self, piece: str):
        if self.calls is not None:
            return self._deltas(self.calls.feed(piece))
        lp = self._take()
        self.sent += len(piece)
        return [self._piece({"content": piece} if self.ex.chat else piece, lp)]

    def done(self, generation: Generation):
        reason, out = generation.finish_reason, []
        if self.calls is not None:
            out += self._deltas(self.calls.close())
            reason = finish_reason(reason, self.calls.calls)
        out.append(self._piece({} if self.ex.chat else "", self._take(), reason))
        if self.include_usage:
            out.append(self._piece({} if self.ex.chat else "", use=self.ex.usage(self.result, generation)))
        return out + ["data: [DONE]\n\n"]

    def failed(self, error: BaseException):
        return [sse(engine_failed(error).body())]

    def cancelled(self):
        return [sse(APIError(500, "the request was cancelled (its reader fell behind, or the server "
                                          "is shutting down)").body())]

    def _take(self) -> dict | None:
        """The pending log-probabilities as ``logprobs`` (None when none)."""
        lp, self.pending = (self.ex.logprobs(self.pending, self.sent) if self.pending else None), []
        return lp

    def _deltas(self, pieces: list) -> list[str]:
        return [sse(P.chat_chunk(self.ex.rid, self.ex.req.model, delta, logprobs=self._take()))
                for delta in openai_deltas(pieces, self.calls)]

    def _piece(self, content, logprobs: dict | None = None, finish: str | None = None, use: dict | None = None) -> str:
        make = P.chat_chunk if self.ex.chat else P.completion_chunk
        return sse(make(self.ex.rid, self.ex.req.model, content, finish, use, logprobs=logprobs))
