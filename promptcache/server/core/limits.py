"""Request limits and browser rules, checked at the HTTP edge before any work (``RequestGuard``).

Every request passes, in this order, before a route sees it:
  1. ``Host`` must be on the allow-list (``allowed_hosts``; None allows any). Against DNS
     rebinding: a web page whose name now resolves to 127.0.0.1 still sends its own name.
  2. A request with a body must say ``Content-Type: application/json`` (a ``charset``, if given,
     must be utf-8). A page may send ``text/plain`` cross-origin without a CORS preflight;
     ``application/json`` always needs one, which the server answers only for ``--cors-origin``.
  3. The body is at most ``max_request_bytes``: a larger ``Content-Length`` is refused before one
     byte is read; a chunked body is refused as soon as it grows past the limit (nothing larger
     than the limit is ever held, so a refused request leaves no memory behind).
  4. The body is parsed (in a worker thread) as strict JSON (no ``NaN`` / ``Infinity``), nested at
     most ``max_json_depth``, with at most ``max_messages`` messages and ``max_chars`` characters
     in all its strings together, every string encodable as UTF-8 (no lone surrogates).
Refusals are OpenAI error objects naming the part (``param``): 400, 413 or 415.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, fields

from ...settings import setting
from .errors import APIError

LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "::1")  # the allow-list when bound to a loopback address
BODY_METHODS = {"POST", "PUT", "PATCH"}
SCOPE_KEY = "promptcache.json"  # where the guard leaves the parsed body for the route


@dataclass(frozen=True)
class Limits:
    """What one request may hold. The defaults are far above any prompt that fits a model's
    context (a 128K-token prompt is about 500K characters) and far below what hurts the server."""

    max_request_bytes: int = setting(8 * 2**20, "Request limit: bytes of a body (refused with 413 before it is read).")
    max_messages: int = setting(2048, "Request limit: messages of a body (refused with 400 before any work).")
    max_chars: int = setting(2_000_000, "Request limit: characters in all strings of a body together (400).")
    max_json_depth: int = setting(32, "Request limit: nesting depth of a JSON body (400).")

    def __post_init__(self):
        for f in fields(self):
            v = getattr(self, f.name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"Limits.{f.name} must be an integer >= 1, got {v!r}")


def parsed_body(scope) -> object:
    """The JSON body the guard parsed and checked (``Request.scope`` of a POST route)."""
    return scope[SCOPE_KEY]


def host_name(header: str) -> str:
    """The name part of a ``Host`` header, lower case: 'LocalHost:8000' -> 'localhost', '[::1]:80' -> '::1'."""
    h = header.strip().lower()
    if h.startswith("["):
        return h[1:h.find("]")] if "]" in h else h
    return h.rsplit(":", 1)[0] if h.count(":") == 1 else h


class RequestGuard:
    """ASGI middleware applying the checks above; ``allowed_hosts``: names (no ports) or None."""

    def __init__(self, app, limits: Limits, allowed_hosts: tuple[str, ...] | None):
        self.app, self.limits = app, limits
        self.allowed = None if allowed_hosts is None else {h.lower().strip("[]") for h in allowed_hosts}

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        try:
            self._check_host(headers.get("host"))
            if scope["method"] in BODY_METHODS:
                _check_content_type(headers.get("content-type"))
                body = await self._read(headers.get("content-length"), receive)
                if body is None:  # the client went away
                    return
                scope[SCOPE_KEY] = await asyncio.to_thread(check_json, body, self.limits)
                receive = _replay(body, receive)
            elif _declared_length(headers.get("content-length")) > self.limits.max_request_bytes:
                raise _too_large(self.limits)
        except APIError as e:
            return await respond(send, e)
        await self.app(scope, receive, send)

    def _check_host(self, host: str | None) -> None:
        if self.allowed is None or "*" in self.allowed:
            return
        if host is None or host_name(host) not in self.allowed:
            raise APIError(400, f"Host header {host!r} is not allowed (this server answers "
                                f"{sorted(self.allowed)}; add names with --allowed-hosts)", "host", "host_not_allowed")

    async def _read(self, length: str | None, receive) -> bytes | None:
        """The body, refused (413) as soon as it is known to pass the limit: by ``Content-Length``
        before reading, or while reading a chunked one."""
        limit = self.limits.max_request_bytes
        if _declared_length(length) > limit:
            raise _too_large(self.limits)
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                raise _too_large(self.limits)
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)


def check_json(body: bytes, limits: Limits) -> object:
    """The parsed body, or an APIError naming what breaks the limits. Runs in a worker thread."""
    if not body.strip():
        raise APIError(400, "the request body is empty (expected a JSON object)")
    try:
        doc = json.loads(body, parse_constant=_no_constant)
    except RecursionError:
        raise APIError(400, f"the JSON body is nested deeper than {limits.max_json_depth} levels") from None
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError, a number of too many digits
        raise APIError(400, f"the request body is not valid JSON: {e}") from None
    messages = doc.get("messages") if isinstance(doc, dict) else None
    if isinstance(messages, list) and len(messages) > limits.max_messages:
        raise APIError(400, f"'messages' holds {len(messages)} messages, the limit is {limits.max_messages} "
                            "(--max-messages)", "messages")
    _walk(doc, limits)
    return doc


def _walk(doc, limits: Limits) -> None:
    """Depth, total characters and UTF-8 encodability of every string, without recursion."""
    stack, chars = [(doc, "", 1)], 0  # (value, its path like 'messages[0].content', its depth)
    while stack:
        value, path, depth = stack.pop()
        if depth > limits.max_json_depth:
            raise APIError(400, f"the JSON body is nested deeper than {limits.max_json_depth} levels "
                                f"(at {path or 'the top'}; --max-json-depth)", path or None)
        if isinstance(value, dict):
            for k, v in value.items():
                chars += _string(k, path or "body", limits)
                stack.append((v, f"{path}.{k}" if path else k, depth + 1))
        elif isinstance(value, list):
            stack.extend((v, f"{path}[{i}]", depth + 1) for i, v in enumerate(value))
        elif isinstance(value, str):
            chars += _string(value, path, limits)
        if chars > limits.max_chars:
            raise APIError(400, f"the request holds more than {limits.max_chars} characters of text "
                                f"(the limit was passed at {path or 'the top'}; --max-chars)", path or None)


def _string(s: str, path: str, limits: Limits) -> int:
    if len(s) > limits.max_chars:
        return len(s)  # refused by the caller; not worth encoding
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        raise APIError(400, f"{path}: the text holds a lone UTF-16 surrogate (not valid Unicode)", path) from None
    return len(s)


def _no_constant(name: str):
    raise ValueError(f"{name} is not a JSON number")


def _declared_length(value: str | None) -> int:
    if value is None:
        return 0
    try:
        n = int(value)
    except ValueError:
        n = -1
    if n < 0:
        raise APIError(400, f"Content-Length {value!r} is not a byte count", "content-length")
    return n


def _check_content_type(value: str | None) -> None:
    media, _, params = (value or "").partition(";")
    charset = [p.split("=", 1)[1].strip().strip('"').lower() for p in params.split(";")
               if p.strip().lower().startswith("charset=")]
    if media.strip().lower() != "application/json" or any(c not in ("utf-8", "utf8") for c in charset):
        raise APIError(415, f"Content-Type must be application/json (UTF-8), got {value!r}", "content-type",
                       "unsupported_media_type")


def _too_large(limits: Limits) -> APIError:
    return APIError(413, f"the request body is larger than {limits.max_request_bytes} bytes (--max-request-bytes)",
                    "body", "request_too_large")


def _replay(body: bytes, receive):
    """A ``receive`` that hands the route the body already read, then the server's own messages
    (after a complete body those are only ``http.disconnect``, which cancels a running answer)."""
    sent = False

    async def replay():
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay


async def respond(send, e: APIError) -> None:
    """Send ``e`` as a complete JSON response (the connection closes after a refused body)."""
    data = json.dumps(e.body()).encode()
    await send({"type": "http.response.start", "status": e.status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode()),
                            (b"connection", b"close")]})
    await send({"type": "http.response.body", "body": data})
