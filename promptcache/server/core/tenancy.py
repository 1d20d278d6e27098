"""``Tenancy``: which namespace a request is in, from its API key.

``api_keys`` maps each key to a namespace; the namespace salts prefix blocks, schema states and
document states, and is never read from the request. Without keys every request is in one
namespace (the engine's) and no key is checked. A key arrives as ``Authorization: Bearer KEY``
(the ``openai`` client) or ``x-api-key: KEY`` (the ``anthropic`` client).
"""

from __future__ import annotations

from fastapi import Request

from .errors import APIError


class Tenancy:
    def __init__(self, api_keys: dict[str, str] | None, namespace: str):
        self.api_keys, self.default = api_keys, namespace

    @property
    def keyed(self) -> bool:
        """Keys map to namespaces (False: one namespace, every request in it)."""
        return self.api_keys is not None

    def namespace(self, request: Request) -> str:
        """The request's namespace; APIError 401 for a missing or unknown key."""
        if self.api_keys is None:
            return self.default
        auth = request.headers.get("authorization", "")
        key = auth[7:].strip() if auth.lower().startswith("bearer ") else request.headers.get("x-api-key", "")
        if key not in self.api_keys:
            raise APIError(401, "missing or invalid API key (send 'Authorization: Bearer KEY' or 'x-api-key: KEY')",
                           code="invalid_api_key")
        return self.api_keys[key]
