"""``TrimAfterLarge``: a request whose body is large is followed by a trim, once it is answered."""

from __future__ import annotations

import asyncio

from promptcache.server.core.trim import TrimAfterLarge


class Asks:
    def __init__(self):
        self.n = 0

    def after_large(self):
        self.n += 1


def _serve(middleware, chunks: list[bytes], fail: bool = False) -> list[str]:
    """One HTTP request through ``middleware``; the app reads the whole body, then answers."""
    events = []

    async def app(scope, receive, send):
        more = True
        while more:
            message = await receive()
            more = message.get("more_body", False)
        events.append(f"answered, asks so far {middleware.trimmer.n}")
        if fail:
            raise RuntimeError("the route failed")

    middleware.app = app
    queue = [{"type": "http.request", "body": c, "more_body": i < len(chunks) - 1} for i, c in enumerate(chunks)]

    async def receive():
        return queue.pop(0)

    async def send(message):
        pass

    try:
        asyncio.run(middleware({"type": "http", "method": "POST"}, receive, send))
    except RuntimeError:
        events.append("raised")
    return events


def test_a_large_body_asks_for_one_trim_after_its_answer():
    m = TrimAfterLarge(None, Asks(), large=1000)
    assert _serve(m, [b"x" * 600, b"x" * 600]) == ["answered, asks so far 0"]  # counted over chunks
    assert m.trimmer.n == 1


def test_a_small_body_asks_for_none():
    m = TrimAfterLarge(None, Asks(), large=1000)
    _serve(m, [b"x" * 999])
    assert m.trimmer.n == 0


def test_a_failed_large_request_still_asks():
    m = TrimAfterLarge(None, Asks(), large=1000)
    assert _serve(m, [b"x" * 2000], fail=True)[-1] == "raised"
    assert m.trimmer.n == 1


def test_other_scopes_pass_through():
    seen = []

    async def app(scope, receive, send):
        seen.append(scope["type"])

    m = TrimAfterLarge(app, Asks(), large=1)
    asyncio.run(m({"type": "lifespan"}, None, None))
    assert seen == ["lifespan"] and m.trimmer.n == 0
