"""``Lifecycle``: one request's life on the server, the same for every API.

A route parses and plans in its own API's terms and hands over an ``Exchange``: what to submit
(a ``Submission``) and how to render the answer. ``Lifecycle.serve`` does the rest:

    1 submit            ``Backend.submit``; a full queue is an APIError 503
    2 await the prefill the job's first event, watching the client:
                        Prefilled -> go on; Failed -> APIError 500; Cancelled or client gone -> 499
    3 count             TTFT, prompt and reused tokens, the 200, the access log's note
    4 answer            stream: a StreamingResponse of ``exchange.sink(result)``'s chunks, the
                        Prefilled event first (the sink's opening)
                        collect: the text pieces and the Generation -> ``exchange.answer(...)``
                        (``Done`` counts the generated tokens, either way)

So an error before the prompt ran is a plain HTTP error with its status; one after it (the engine
failing mid-decode) ends a stream with the sink's error event.

Cancellation, one mechanism: a job is cancelled in one place, ``Call.close``, which every reader
of a job runs (in a ``finally``) when it stops before the job's last event. A client that goes
away reaches it by cancelling the coroutine that reads: ``_unless_gone`` while the route waits
(queued, prefilling, collecting), Starlette's disconnect listener while a stream is sent. The
scheduler frees the request's blocks at its next step.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass
from typing import AsyncIterator

from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from ...engine import PromptSpec, SamplingParams
from ...engine.prefill.results import Generation, PrefillResult
from ...errors import PromptCacheError
from .access import note
from .backend import Backend, Job, QueueFull
from .counts import TokenCounts
from .errors import APIError
from .events import Event, EventSink, Prefilled
from .metrics import Metrics


@dataclass(frozen=True)
class Submission:
    """What a route asks the engine to run: a request's prompt spec and sampling settings."""

    prompt: PromptSpec
    prompt_tokens: int  # the prompt's length, for usage and metrics
    params: SamplingParams
    constraints: tuple = ()  # per-request logits processors (JSON output, tool calls); fresh ones per request
    logprobs: int | None = None  # None: none; k: each token's log-probability and k rivals


class Exchange:
    """One API's side of one request: what to submit and how its answer is rendered. A route
    subclasses it; parsing and rendering stay in the API's package."""

    submission: Submission
    stream: bool = False

    def sink(self, result: PrefillResult) -> EventSink:
        """The streamed answer's renderer (``stream``): its ``prefilled`` opens the stream."""
        raise NotImplementedError

    def answer(self, result: PrefillResult, text: str, generation: Generation) -> Response | dict:
        """The collected answer (not ``stream``): ``text`` is every text piece, joined."""
        raise NotImplementedError


class ClientGone(PromptCacheError):
    """The client disconnected (or the request was cancelled) before its answer was sent: answered 499."""


def engine_failed(error: BaseException) -> APIError:
    return APIError(500, f"the engine failed: {error}")


def sse(obj: dict) -> str:
    """One server-sent event of data only (``data: JSON``), as OpenAI's streams and the studio's send."""
    return f"data: {json.dumps(obj)}\n\n"


class Call:
    """A submitted job, read by one coroutine at a time; ``close`` cancels it unless it ended."""

    def __init__(self, backend: Backend, job: Job, request: Request, metrics: Metrics):
        self.backend, self.job, self.ended = backend, job, False
        self.meter = _Meter(request, metrics)

    async def next(self) -> Event:
        event = await self.job.events.get()
        self.ended = self.ended or event.last
        list(event.to(self.meter))
        return event

    def close(self) -> None:
        """Stop reading: an unfinished job is cancelled (the scheduler frees its blocks at its next step)."""
        if not self.ended:
            self.ended = True
            self.backend.cancel(self.job)

    async def pump(self, sink: EventSink, first: Event | None = None) -> AsyncIterator[str]:
        """``sink``'s chunks for each event (``first``, then the job's), to the job's last; the job is
        cancelled if the reader stops before it (the one place a job is cancelled)."""
        try:
            if first is not None:
                for chunk in first.to(sink):
                    yield chunk
            while not self.ended:
                for chunk in (await self.next()).to(sink):
                    yield chunk
        finally:
            self.close()


class Lifecycle:
    """Serves ``Exchange``s on ``backend``, counting them in ``metrics``."""

    def __init__(self, backend: Backend, metrics: Metrics):
        self.backend, self.metrics = backend, metrics

    def submit(self, request: Request, sub: Submission) -> Call:
        try:
            job = self.backend.submit(sub.prompt, sub.params, sub.constraints, sub.logprobs)
        except QueueFull as e:
            raise APIError(503, f"the server is busy: {e}; retry later") from None
        return Call(self.backend, job, request, self.metrics)

    async def serve(self, request: Request, exchange: Exchange) -> Response | dict:
        call = self.submit(request, exchange.submission)
        try:
            result = await _unless_gone(request, _prefilled(call))
            self._count(request, call, exchange.submission, result)
            if exchange.stream:
                return StreamingResponse(call.pump(exchange.sink(result), Prefilled(result)),
                                         media_type="text/event-stream")
            collected = await _unless_gone(request, _collect(call))
            return exchange.answer(result, "".join(collected.pieces), collected.generation)
        except ClientGone:
            return Response(status_code=499)
        except BaseException:
            call.close()
            raise

    def _count(self, request: Request, call: Call, sub: Submission, result: PrefillResult) -> None:
        ttft, m = time.perf_counter() - call.job.submitted, self.metrics
        m.ttft.observe(ttft)
        counts = TokenCounts.of(result)
        note(request, **counts.fields(), ttft=ttft)
        m.count_prompt(counts)
        m.requests.labels(request.url.path, "200").inc()
        for tier, n in result.hit_tiers.items():
            m.tier_hits.labels(tier).inc(n)


class _Meter(EventSink):
    """Counts a finished answer's generated tokens (metrics and the access log)."""

    def __init__(self, request: Request, metrics: Metrics):
        self.request, self.metrics = request, metrics

    def done(self, generation: Generation):
        self.metrics.generated_tokens.inc(len(generation.token_ids))
        note(self.request, generated=len(generation.token_ids))
        return ()


class _First(EventSink):
    """The first event: the prefill's result, or why there is none."""

    result: PrefillResult | None = None

    def prefilled(self, result: PrefillResult):
        self.result = result
        return ()

    def failed(self, error: BaseException):
        raise engine_failed(error)

    def cancelled(self):
        raise ClientGone


class _Collected(_First):
    """A whole answer: its text pieces and the Generation."""

    def __init__(self):
        self.pieces: list[str] = []
        self.generation: Generation | None = None

    def text(self, piece: str):
        self.pieces.append(piece)
        return ()

    def done(self, generation: Generation):
        self.generation = generation
        return ()


async def _prefilled(call: Call) -> PrefillResult:
    first = _First()
    try:
        list((await call.next()).to(first))
    except BaseException:
        call.close()
        raise
    assert first.result is not None, "a job's first event is Prefilled, Failed or Cancelled"
    return first.result


async def _collect(call: Call) -> _Collected:
    collected = _Collected()
    async for _ in call.pump(collected):
        pass
    return collected


async def _unless_gone(request: Request, work):
    """``work``'s result, unless the client disconnects first: then ``work`` is cancelled (its
    reader's ``finally`` cancels the job) and ``ClientGone`` is raised. The request's body is read
    by then, so the next ASGI message is the disconnect."""
    task, gone = asyncio.ensure_future(work), asyncio.ensure_future(_disconnect(request))
    try:
        await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not task.done():
            task.cancel()
    if task.done() and not task.cancelled():
        return task.result()
    await asyncio.gather(task, return_exceptions=True)  # its reader has cancelled the job
    raise ClientGone


async def _disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass
