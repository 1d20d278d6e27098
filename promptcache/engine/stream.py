"""``GenerationStream``: iterate for text pieces as one request is decoded; ``result`` afterwards.

The request runs on the engine's serving core beside any others (``core.Engine.stream``): each
step the iterating thread takes advances every request in flight. Leaving the loop early
(``break``, an exception, garbage collection) cancels the request and frees its blocks at once.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Iterator

from .serving_core.request import Request
from .prefill.results import Generation

if TYPE_CHECKING:
    from .serving_core.core import Engine

__all__ = ["GenerationStream"]


class GenerationStream:
    def __init__(self, engine: "Engine", request: Request):
        self.engine, self.request = engine, request
        self.result: Generation | None = None

    def __iter__(self) -> Iterator[str]:
        for out in self.engine.stream(self.request):
            if out.text:
                yield out.text
        if self.request.error is not None:
            raise self.request.error
        self.result = self.request.generation()

    def run(self) -> Generation:
        """Decode to the end without streaming."""
        for _ in self:
            pass
        return self.result
