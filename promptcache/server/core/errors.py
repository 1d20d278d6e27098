"""``APIError``: an error the server answers with its HTTP status, as an OpenAI error object.

Raised anywhere below a route (limits, the lifecycle, a preparer); the app's handler answers it.
The Anthropic routes answer the same errors in their own shape (``anthropic.protocol.AnthropicError``).
"""

from __future__ import annotations

from ...errors import PromptCacheError


class APIError(PromptCacheError):
    """An error answered as ``{"error": {message, type, param, code}}`` with ``status``."""

    TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
             405: "invalid_request_error", 413: "invalid_request_error", 415: "invalid_request_error",
             503: "server_overloaded", 500: "server_error"}

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.TYPES.get(self.status, "error"),
                          "param": self.param, "code": self.code}}
