"""``GenerationStream``: iterate for text pieces as one request is decoded; ``result`` afterwards.

It drives its own ``Scheduler`` holding one request (so threads sharing an engine never step
each other's requests); a server shares one scheduler between requests instead. Leaving the
loop early (``break``, an exception, garbage collection) cancels the request and releases its
cache at once.
"""

from __future__ import annotations

from typing import Callable, Iterator

from .request import Request
from .results import Generation, PrefillResult
from .runner import ModelRunner
from .sampling import SamplingParams
from .scheduler import Scheduler

__all__ = ["GenerationStream"]


class GenerationStream:
    def __init__(self, runner: ModelRunner, tokenizer, start: Callable[[int], PrefillResult],
                 params: SamplingParams):
        self.runner, self.tokenizer, self.start, self.params = runner, tokenizer, start, params
        self.request: Request | None = None
        self.result: Generation | None = None

    def __iter__(self) -> Iterator[str]:
        self.request = req = Request(self.start, self.params, self.tokenizer)
        scheduler = Scheduler(self.runner)
        scheduler.add(req)
        try:
            while scheduler.has_work:
                for out in scheduler.step():
                    if out.text:
                        yield out.text
        finally:
            if scheduler.has_work:  # left early: release the cache now
                req.cancel()
                scheduler.step()
        self.result = req.generation()

    def run(self) -> Generation:
        """Decode to the end without streaming."""
        for _ in self:
            pass
        return self.result
