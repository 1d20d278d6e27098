"""OpenAI's request and response shapes (the subset served), and OpenAI-style errors.

Unknown request fields are ignored, as OpenAI-compatible servers do; the extension fields
(``pml``, ``documents``, ``recompute``) arrive top-level, which is what the ``openai`` client's
``extra_body=`` sends.
"""

from __future__ import annotations

import time
import uuid
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from ..engine.recompute import check_recompute
from ..errors import PromptCacheError


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


class BaseRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str
    max_tokens: int | None = None
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=-(2**63), le=2**64 - 1)  # what a torch.Generator takes
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    # extensions (extra_body)
    pml: str | None = None  # a PML prompt for a loaded schema
    recompute: float | str | None = None  # "auto" or a fraction in [0, 1]; None: the engine's setting

    @field_validator("recompute")
    @classmethod
    def _recompute(cls, v):
        return None if v is None else check_recompute(v, "recompute")

    def stop_list(self) -> list[str] | None:
        return [self.stop] if isinstance(self.stop, str) else self.stop


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: bool = False


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: str
    text: str | None = None


class Message(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[ContentPart] | None = None


class ChatRequest(BaseRequest):
    messages: list[Message] = Field(default_factory=list)
    max_completion_tokens: int | None = None
    documents: list[str] | None = None  # DocumentStore ids, placed before the last user message


class CompletionRequest(BaseRequest):
    prompt: str | list[str] | list[int] | None = None
    documents: None = None  # documents are a chat extension


BaseRequest.model_rebuild()
ChatRequest.model_rebuild()
CompletionRequest.model_rebuild()


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int, exact: bool = True,
          recomputed_tokens: int = 0) -> dict:
    """OpenAI's usage object; ``cached_tokens``: prompt tokens served from stored states (recomputed
    ones are not). Extension fields: ``exact`` (the prompt's state equals a plain prefill's; false:
    the answer is approximate) and ``recomputed_tokens`` (cached tokens computed afresh)."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens},
            "exact": exact, "recomputed_tokens": recomputed_tokens}


def chat_response(rid: str, model: str, text: str, finish: str, use: dict) -> dict:
    return {"id": rid, "object": "chat.completion", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                         "finish_reason": finish, "logprobs": None}],
            "usage": use}


def chat_chunk(rid: str, model: str, delta: dict, finish: str | None = None, use: dict | None = None) -> dict:
    choices = [] if use is not None else [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}]
    out = {"id": rid, "object": "chat.completion.chunk", "created": int(time.time()), "model": model,
           "choices": choices}
    if use is not None:
        out["usage"] = use
    return out


def completion_response(rid: str, model: str, text: str, finish: str, use: dict) -> dict:
    return {"id": rid, "object": "text_completion", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "text": text, "finish_reason": finish, "logprobs": None}],
            "usage": use}


def completion_chunk(rid: str, model: str, text: str, finish: str | None = None, use: dict | None = None) -> dict:
    choices = [] if use is not None else [{"index": 0, "text": text, "finish_reason": finish, "logprobs": None}]
    out = {"id": rid, "object": "text_completion", "created": int(time.time()), "model": model, "choices": choices}
    if use is not None:
        out["usage"] = use
    return out
