"""The one error type of the language layer."""

from __future__ import annotations


class PMLError(ValueError):
    """Bad PML input. The message names the source (file or ``<string>``), the line and what is wrong.

    ``source``, ``line`` and ``reason`` are kept as attributes so tools (``promptcache validate``)
    can print ``file:line: message`` without parsing the message.
    """

    def __init__(self, reason: str, source: str = "<string>", line: int | None = None):
        self.reason = reason
        self.source = source
        self.line = line
        where = f"{source}:{line}" if line is not None else source
        super().__init__(f"{where}: {reason}")
