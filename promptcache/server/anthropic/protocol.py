"""Anthropic's Messages API shapes (the subset served): request, response, stream events, errors.

Decisions: unknown request fields are refused (400 naming the field), unlike the OpenAI routes,
so a client never gets an answer that silently ignored what it asked for. Served: ``model``,
``max_tokens`` (required, as in the API), ``messages`` and ``system`` (a string or text blocks),
``stop_sequences``, ``stream``, ``temperature`` ([0, 1], default 1) and ``top_p`` (clients
whose ``create`` no longer takes them send them in ``extra_body``), ``metadata`` (accepted, not
used), a top-level ``cache_control`` (a breakpoint after the last message's last block), ``tools``
and ``tool_choice`` with ``tool_use`` / ``tool_result`` blocks (``tools.py``). Refused
with a 400 naming them: ``top_k``, ``thinking`` and every other field; content blocks other than
``text``, ``tool_use`` and ``tool_result``; ``cache_control`` on a tool or a ``tool_use`` block.
"""

from __future__ import annotations

import json
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ..core.errors import APIError
from ..openai.protocol import new_id

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


_SCALARS = {"str", "int", "float", "bool", "dict", "list", "none"}


def _is_branch(part) -> bool:
    """A union branch's tag in a pydantic location ("str", "list[TextBlock]", "TextBlock"), not a field."""
    return isinstance(part, str) and (part in _SCALARS or "[" in part or part[:1].isupper())


def invalid(e: ValidationError, where: str = "") -> AnthropicError:
    """A 400 naming the field at fault. Of a union's errors the deepest is the one meant: a bad
    ``cache_control`` inside a ``system`` block list is ``system.0.cache_control.ttl: ...``, not the
    string branch's ``system.str: Input should be a valid string``."""
    err = max(e.errors(), key=lambda x: len([p for p in x["loc"] if not _is_branch(p)]))
    field = ".".join([where] * bool(where) + [str(p) for p in err["loc"] if not _is_branch(p)]) or None
    msg = "is not supported by this server" if err["type"] == "extra_forbidden" else err["msg"]
    return AnthropicError(400, f"{field}: {msg}", field)


class CacheControl(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["ephemeral"]
    ttl: Literal["5m", "1h"] = "5m"


class TextBlock(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text"]
    text: str
    cache_control: CacheControl | None = None


class ToolUseBlock(BaseModel):
    """An assistant's call in the history."""
    model_config = ConfigDict(extra="forbid")
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict
    cache_control: CacheControl | None = None  # refused (tools.py): no place for it in a call's JSON


class ToolResultBlock(BaseModel):
    """A user turn's answer to a call; ``is_error`` shows as an ``Error: `` before its text."""
    model_config = ConfigDict(extra="forbid")
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[TextBlock] = ""
    is_error: bool = False
    cache_control: CacheControl | None = None


class ToolSpec(BaseModel):
    """A client tool (``type`` "custom" or absent); server tools are refused."""
    model_config = ConfigDict(extra="forbid")
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")  # written into the grammar as is
    description: str | None = None
    input_schema: dict
    type: Literal["custom"] | None = None
    cache_control: CacheControl | None = None  # refused (tools.py): tools render inside the template


class ToolChoice(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None  # type "tool"
    disable_parallel_tool_use: bool = False


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
    tools: list[ToolSpec] | None = None  # tools.py
    tool_choice: ToolChoice | None = None


class CountTokensRequest(BaseModel):
    """``POST /v1/messages/count_tokens``: the prompt fields of a message request, no sampling."""
    model_config = ConfigDict(extra="forbid")

    model: str
    messages: list[InputMessage] = Field(min_length=1)
    system: str | list[TextBlock] | None = None
    cache_control: CacheControl | None = None
    tools: list[ToolSpec] | None = None
    tool_choice: ToolChoice | None = None

    def as_request(self) -> MessagesRequest:
        """The message request it would be (its prompt renders the same; max_tokens is not counted)."""
        return MessagesRequest.model_construct(max_tokens=1, **dict(self))


def message(mid: str, model: str, text: str | None, stop_reason: str | None, stop_sequence: str | None,
            usage: dict, tool_uses: list[dict] | None = None) -> dict:
    """A whole answer: a text block (absent when a tool call came without text), then its calls."""
    content = [{"type": "text", "text": text or ""}] if text or (stop_reason and not tool_uses) else []
    content += tool_uses or []
    return {"id": mid, "type": "message", "role": "assistant", "model": model, "content": content,
            "stop_reason": stop_reason, "stop_sequence": stop_sequence, "usage": usage}


def usage(input_tokens: int, created: int, read: int, output_tokens: int) -> dict:
    """Anthropic's counts: ``input_tokens`` are the prompt tokens neither read from nor written to
    the cache, so input + created + read = the prompt."""
    return {"input_tokens": input_tokens, "cache_creation_input_tokens": created,
            "cache_read_input_tokens": read, "output_tokens": output_tokens}


def stop_reason(finish: str, matched: str | None, called: bool = False) -> str:
    """Engine finish reason -> Anthropic's: ``length`` is ``max_tokens``; ``stop`` is ``tool_use``
    when the answer called tools, ``stop_sequence`` when a stop sequence ended the text, else
    ``end_turn`` (an EOS token)."""
    if finish == "length":
        return "max_tokens"
    if called:
        return "tool_use"
    return "stop_sequence" if matched is not None else "end_turn"


def event(kind: str, data: dict) -> str:
    """One server-sent event: ``event: KIND`` and its JSON (which repeats the kind as ``type``)."""
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **data})}\n\n"


def start_events(mid: str, model: str, use: dict, text_block: bool = True) -> list[str]:
    """``text_block``: open content block 0 as text at once (False: blocks open as they come)."""
    block = [event("content_block_start", {"index": 0, "content_block": {"type": "text", "text": ""}})]
    return [event("message_start", {"message": message(mid, model, "", None, None, use)}),
            *(block if text_block else []), event("ping", {})]


def delta_event(text: str) -> str:
    return event("content_block_delta", {"index": 0, "delta": {"type": "text_delta", "text": text}})


def end_events(reason: str, matched: str | None, use: dict, text_block: bool = True) -> list[str]:
    """``text_block``: close content block 0 first (False: the blocks were closed as they ended)."""
    block = [event("content_block_stop", {"index": 0})]
    return [*(block if text_block else []),
            event("message_delta", {"delta": {"stop_reason": reason, "stop_sequence": matched}, "usage": use}),
            event("message_stop", {})]


def error_event(e: APIError) -> str:
    return event("error", {"error": AnthropicError.of(e).body()["error"]})


def new_message_id() -> str:
    return new_id("msg").replace("-", "_")


__all__ = ["AnthropicError", "CacheControl", "CountTokensRequest", "InputMessage", "MAX_BREAKPOINTS", "MessagesRequest", "TTL_SECONDS",
           "TextBlock", "ToolChoice", "ToolResultBlock", "ToolSpec", "ToolUseBlock", "delta_event", "end_events",
           "error_event", "event", "invalid", "message", "new_message_id", "start_events",
           "stop_reason", "usage"]
