"""``TrimAfterLarge``: once a request with a large body is answered, freed heap pages go back to the OS.

A large body is a large transient: a 2M-character prompt to tokenize, ~7 MB of token ids to
detokenize, a long chat. Its parse, its tokens and its answer are freed when the answer is
sent, but glibc keeps most of those pages in its arenas (``promptcache.heap`` says why), and the
serving process grew by tens of MB with each such request in the soak (eval/results/reliability.md).
The middleware counts the body's bytes as they are received and, after the answer, asks the
``Trimmer`` (its own thread: the event loop never waits for the trim).
"""

from __future__ import annotations

from ...heap import Trimmer

LARGE_BODY = 2**20  # bytes of a request body from which its answer is followed by a trim


class TrimAfterLarge:
    """ASGI middleware; ``trimmer``: shared by the app, ``large``: bytes of a body that count."""

    def __init__(self, app, trimmer: Trimmer, large: int = LARGE_BODY):
        self.app, self.trimmer, self.large = app, trimmer, large

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        size = 0

        async def counted():
            nonlocal size
            message = await receive()
            size += len(message.get("body", b""))
            return message

        try:
            await self.app(scope, counted, send)
        finally:
            if size >= self.large:
                self.trimmer.after_large()
