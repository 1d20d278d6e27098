"""What a job tells its route, in order: typed events, and ``EventSink``, what a route makes of them.

The worker (``backend.py``) puts one event at a time on the job's asyncio queue:

    Prefilled(result)   the prompt ran (PrefillResult: usage, TTFT); always first, or nothing is
    Logprob(entry)      a token's log-probability (requests that ask), before the text that holds it
    Text(piece)         a decoded text piece
    Done(generation)    finished; its blocks are free again                          (last)
    Failed(error)       the engine failed the request; nothing more follows          (last)
    Cancelled()         the request was cancelled (client gone, reader too slow, shutdown) (last)

An event hands itself to a sink (``event.to(sink)`` calls the sink's method for its type), so a
route renders by overriding methods, never by testing what an event is.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Iterable

from ...engine.prefill.results import Generation, PrefillResult, TokenLogprob


class EventSink:
    """What a job's events become: one method per event type, each returning the chunks to send
    (none by default). A collecting sink keeps what it needs and returns nothing."""

    def prefilled(self, result: PrefillResult) -> Iterable[str]:
        return ()

    def logprob(self, entry: TokenLogprob) -> Iterable[str]:
        return ()

    def text(self, piece: str) -> Iterable[str]:
        return ()

    def done(self, generation: Generation) -> Iterable[str]:
        return ()

    def failed(self, error: BaseException) -> Iterable[str]:
        return ()

    def cancelled(self) -> Iterable[str]:
        return ()


@dataclass(frozen=True)
class Prefilled:
    result: PrefillResult
    last: ClassVar[bool] = False

    def to(self, sink: EventSink) -> Iterable[str]:
        return sink.prefilled(self.result)


@dataclass(frozen=True)
class Logprob:
    entry: TokenLogprob
    last: ClassVar[bool] = False

    def to(self, sink: EventSink) -> Iterable[str]:
        return sink.logprob(self.entry)


@dataclass(frozen=True)
class Text:
    piece: str
    last: ClassVar[bool] = False

    def to(self, sink: EventSink) -> Iterable[str]:
        return sink.text(self.piece)


@dataclass(frozen=True)
class Done:
    generation: Generation
    last: ClassVar[bool] = True

    def to(self, sink: EventSink) -> Iterable[str]:
        return sink.done(self.generation)


@dataclass(frozen=True)
class Failed:
    error: BaseException
    last: ClassVar[bool] = True

    def to(self, sink: EventSink) -> Iterable[str]:
        return sink.failed(self.error)


@dataclass(frozen=True)
class Cancelled:
    last: ClassVar[bool] = True

    def to(self, sink: EventSink) -> Iterable[str]:
        return sink.cancelled()


Event = Prefilled | Logprob | Text | Done | Failed | Cancelled
