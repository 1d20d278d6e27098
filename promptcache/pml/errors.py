"""The error types of the language layer (no torch)."""

from __future__ import annotations

from ..errors import PromptCacheError


class PMLError(PromptCacheError, ValueError):
    """Bad PML input. The message names the source (file or ``<string>``), the line and what is wrong.

    ``source``, ``line`` and ``reason`` are kept as attributes so tools (``promptcache validate``)
    can print ``file:line: message`` without parsing the message.
    """

    exit_code = 1

    def __init__(self, reason: str, source: str = "<string>", line: int | None = None):
        self.reason = reason
        self.source = source
        self.line = line
        where = f"{source}:{line}" if line is not None else source
        super().__init__(f"{where}: {reason}")


class SourceFileError(PMLError):
    """A schema, prompt or ``src`` file that is missing or cannot be read (an environment problem,
    ``exit_code`` 2; a file that exists but is not usable PML is a plain ``PMLError``)."""

    exit_code = 2


MAX_ERRORS = 20  # errors of one file kept and printed; the rest are counted


class PMLErrors(PMLError):
    """Several errors of one file, in document order (``errors``; at most ``MAX_ERRORS`` kept,
    ``more`` counts the others). Its attributes are the first error's; ``str`` is one line per error,
    so ``promptcache validate`` shows them all in one run."""

    def __init__(self, errors: list[PMLError], more: int = 0):
        first = errors[0]
        super().__init__(first.reason, first.source, first.line)
        self.errors, self.more = errors, more
        tail = [f"{first.source}: {more} more errors not shown"] if more else []
        self.args = ("\n".join([str(e) for e in errors] + tail),)


def raise_collected(errors: list[PMLError]) -> None:
    """Raise what a reading collected: nothing, the one error as it is, or ``PMLErrors`` (by line:
    the checks over a whole scope, such as duplicate names, run after its elements)."""
    errors = sorted(errors, key=lambda e: float("inf") if e.line is None else e.line)
    if len(errors) == 1:
        raise errors[0]
    if errors:
        raise PMLErrors(errors[:MAX_ERRORS], len(errors) - MAX_ERRORS if len(errors) > MAX_ERRORS else 0)
