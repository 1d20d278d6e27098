"""Anthropic's Messages API shapes (the subset served): request, response, stream events, errors.

Decisions: unknown request fields are refused (400 naming the field), unlike the OpenAI routes,
so a client never gets an answer that silently ignored what it asked for. Served: ``model``,
``max_tokens`` (required, as in the API), ``messages`` and ``system`` (a string or text blocks),
``stop_sequences``, ``stream``, ``temperature`` ([0, 1], default 1) and ``top_p`` (clients
whose ``create`` no longer takes them send them in ``extra_body``), ``metadata`` (accepted, not
used), a top-level ``cache_control`` (a breakpoint after the last message's last block). Refused with a 400 naming them: ``tools``, ``tool_choice``, ``top_k``,
``thinking`` and every other field; content blocks other than ``text``.
"""

from __future__ import annotations

import json
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from .protocol import APIError, new_id

TTL_SECONDS = {"5m": 300, "1h": 3600}
MAX_BREAKPOINTS = 4  # the API's limit of cache_control blocks per request


class AnthropicError(APIError):
    """An APIError answered in Anthropic's shape: ``{"type": "error", "error": {type, message}}``."""

    TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
             413: "request_too_large", 429: "rate_limit_error", 500: "api_error", 503: "overloaded_error"}

    def body(self) -> dict:
        where = f" (at {self.param})" if self.param and self.param not in self.message else ""
        return {"type": "error", "error": {"type": self.TYPES.get(self.status, "api_error"),
                                           "message": self.message + where}}

    @classmethod
    def of(cls, e: APIError) -> "AnthropicError":
        return e if isinstance(e, cls) else cls(e.status, e.message, e.param, e.code)


class CacheControl(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["ephemeral"]
    ttl: Literal["5m", "1h"] = "5m"


class TextBlock(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text"]
    text: str
    cache_control: CacheControl | None = None


class InputMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["user", "assistant"]
    content: str | list[dict]  # blocks are checked one by one (``TextBlock``) so an error names its index


class MessagesRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str
    max_tokens: int = Field(ge=1)
    messages: list[InputMessage] = Field(min_length=1)
    system: str | list[TextBlock] | None = None
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: float = Field(1.0, ge=0.0, le=1.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    metadata: dict | None = None
    cache_control: CacheControl | None = None  # automatic caching: a breakpoint after the last block


def message(mid: str, model: str, text: str, stop_reason: str | None, stop_sequence: str | None,
            usage: dict) -> dict:
    content = [{"type": "text", "text": text}] if text or stop_reason else []
    return {"id": mid, "type": "message", "role": "assistant", "model": model, "content": content,
            "stop_reason": stop_reason, "stop_sequence": stop_sequence, "usage": usage}


def usage(input_tokens: int, created: int, read: int, output_tokens: int) -> dict:
    """Anthropic's counts: ``input_tokens`` are the prompt tokens neither read from nor written to
    the cache, so input + created + read = the prompt."""
    return {"input_tokens": input_tokens, "cache_creation_input_tokens": created,
            "cache_read_input_tokens": read, "output_tokens": output_tokens}


def stop_reason(finish: str, matched: str | None) -> str:
    """Engine finish reason -> Anthropic's: ``length`` is ``max_tokens``; ``stop`` is
    ``stop_sequence`` when a stop sequence ended the text, else ``end_turn`` (an EOS token)."""
    if finish == "length":
        return "max_tokens"
    return "stop_sequence" if matched is not None else "end_turn"


def event(kind: str, data: dict) -> str:
    """One server-sent event: ``event: KIND`` and its JSON (which repeats the kind as ``type``)."""
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **data})}\n\n"


def start_events(mid: str, model: str, use: dict) -> list[str]:
    return [event("message_start", {"message": message(mid, model, "", None, None, use)}),
            event("content_block_start", {"index": 0, "content_block": {"type": "text", "text": ""}}),
            event("ping", {})]


def delta_event(text: str) -> str:
    return event("content_block_delta", {"index": 0, "delta": {"type": "text_delta", "text": text}})


def end_events(reason: str, matched: str | None, use: dict) -> list[str]:
    return [event("content_block_stop", {"index": 0}),
            event("message_delta", {"delta": {"stop_reason": reason, "stop_sequence": matched}, "usage": use}),
            event("message_stop", {})]


def error_event(e: APIError) -> str:
    return event("error", {"error": AnthropicError.of(e).body()["error"]})


def new_message_id() -> str:
    return new_id("msg").replace("-", "_")


__all__ = ["AnthropicError", "CacheControl", "InputMessage", "MAX_BREAKPOINTS", "MessagesRequest", "TTL_SECONDS",
           "TextBlock", "delta_event", "end_events", "error_event", "message", "new_message_id", "start_events",
           "stop_reason", "usage"]
