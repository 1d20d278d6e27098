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
