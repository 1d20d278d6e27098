"""One access-log line per request (logger ``promptcache.access``, INFO), written when the response
has been sent in full (streamed answers too):

    POST /v1/chat/completions 200 prompt=130 cached=100 recomputed=28 new=2 generated=16 ttft=12.3ms duration=210.4ms

``cached``, ``recomputed`` and ``new`` are ``TokenCounts`` (``counts.py``: the one definition the
usage, ``/metrics`` and the studio share; prompt = cached + recomputed + new). Routes add what
they know with ``note(request, prompt=..., cached=..., recomputed=..., new=..., generated=..., ttft=...)``
(kept in the ASGI scope's ``state``); fields a route did not note are left out of the line. A
response that never completes (the client went away) is logged with status 499.
"""

from __future__ import annotations

import logging
import time

log = logging.getLogger("promptcache.access")

FIELDS = ("prompt", "cached", "recomputed", "new", "generated")


def note(request, **fields) -> None:
    """Record counts (``FIELDS``) and ``ttft`` (seconds) for the line."""
    request.scope.setdefault("state", {}).setdefault("access", {}).update(fields)


class AccessLog:
    """ASGI middleware writing the line; wraps the whole app."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        t0, status, done = time.perf_counter(), [499], [False]

        async def sending(message):
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)
            if message["type"] == "http.response.body" and not message.get("more_body", False):
                done[0] = True

        try:
            await self.app(scope, receive, sending)
        finally:
            log.info("%s", line(scope, status[0] if done[0] else 499, time.perf_counter() - t0))


def line(scope, status: int, duration: float) -> str:
    state = scope.get("state", {}).get("access", {})
    parts = [scope["method"], scope["path"], str(status)]
    parts += [f"{k}={state[k]}" for k in FIELDS if k in state]
    if "ttft" in state:
        parts.append(f"ttft={state['ttft'] * 1e3:.1f}ms")
    parts.append(f"duration={duration * 1e3:.1f}ms")
    return " ".join(parts)
