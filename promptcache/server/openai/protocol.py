"""OpenAI's request and response shapes (the subset served), and OpenAI-style errors.

Unknown request fields are refused (400 naming the field; ``fields.py`` says which
fields are served and how, ``tools.py`` the tool fields); the extension fields (``pml``, ``documents``, ``recompute``) arrive
top-level, which is what the ``openai`` client's ``extra_body=`` sends. One exception: the fields
a router in front of replicas adds to every request it forwards (sglang-router and vllm-router
re-serialize their own request types) are dropped when they hold their "off" value (``ROUTER_NEUTRAL``); set to
anything else they are refused like any unknown field.
"""

from __future__ import annotations

import time
import uuid
from typing import Literal

from fastapi import Request
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from ...engine.prefill.recompute import check_recompute
from ..core.errors import APIError
from ..core.limits import parsed_body


# field -> the values that ask for nothing (None always does); what sglang-router forwards
ROUTER_NEUTRAL = {"no_stop_trim": (False,), "continue_final_message": (False,), "skip_special_tokens": (True,),
                  "spaces_between_special_tokens": (True,), "separate_reasoning": (True,),
                  "stream_reasoning": (True,), "return_hidden_states": (False,), "top_k": (-1, 0),
                  "min_p": (0,), "repetition_penalty": (1,), "stop_token_ids": ([],), "lora_path": (),
                  "session_params": (), "chat_template_kwargs": ({},), "regex": (), "ebnf": (), "rid": (),
                  "sampling_seed": (), "include_reasoning": (True, False)}  # vllm-router: no reasoning here either way


class BaseRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    @model_validator(mode="before")
    @classmethod
    def _drop_router_defaults(cls, body):
        if isinstance(body, dict):
            body = {k: v for k, v in body.items()
                    if not (k in ROUTER_NEUTRAL and k not in cls.model_fields and (v is None or v in ROUTER_NEUTRAL[k]))}
        return body

    model: str
    max_tokens: int | None = None
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=-(2**63), le=2**64 - 1)  # what a torch.Generator takes
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    frequency_penalty: float = 0.0  # only 0 (fields.check)
    presence_penalty: float = 0.0
    user: str | None = None  # accepted, not used
    metadata: dict | None = None  # accepted, not used
    prompt_cache_key: str | None = None  # accepted: reuse is keyed by content; a router may place by it
    # extensions (extra_body)
    pml: str | None = None  # a PML prompt for a loaded schema
    recompute: float | str | None = None  # "auto" or a fraction in [0, 1]; None: the engine's setting
    min_tokens: int = Field(0, ge=0)  # vLLM's: no end of sequence before this many tokens
    ignore_eos: bool = False  # vLLM's: generate max_tokens whatever the model says (benchmarks)

    @field_validator("recompute")
    @classmethod
    def _recompute(cls, v):
        return None if v is None else check_recompute(v, "recompute")

    def stop_list(self) -> list[str] | None:
        return [self.stop] if isinstance(self.stop, str) else self.stop


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="allow")  # a part's other fields are refused by the preparer, by index
    type: str
    text: str | None = None


class CallFunction(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str
    arguments: str  # a JSON object's text, as the API sends it


class MessageToolCall(BaseModel):
    """A call in an assistant message of the history (``tools.py`` renders it)."""
    model_config = ConfigDict(extra="forbid")
    id: str
    type: Literal["function"] = "function"
    function: CallFunction


class Message(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    tool_calls: list[MessageToolCall] | None = None  # assistant messages
    tool_call_id: str | None = None  # tool messages: the call answered


class FunctionDef(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")  # OpenAI's rule; it is written into the grammar as is
    description: str | None = None
    parameters: dict | None = None  # a JSON Schema of the arguments object (None: any object)
    strict: bool | None = None  # accepted: arguments always follow the schema here


class Tool(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function"]
    function: FunctionDef


class ChosenFunction(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function"]
    function: ChosenFunction


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text", "json_object", "json_schema"]
    json_schema: dict | None = None  # {"name", "schema", "strict"}


class ChatRequest(BaseRequest):
    messages: list[Message] = Field(default_factory=list)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    response_format: ResponseFormat | None = None
    tools: list[Tool] | None = None  # served by tools.py
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None  # None: true
    documents: list[str] | None = None  # DocumentStore ids, placed before the last user message


class CompletionRequest(BaseRequest):
    prompt: str | list[str] | list[int] | None = None
    logprobs: int | None = None  # rivals per token (0-5)
    documents: None = None  # documents are a chat extension


BaseRequest.model_rebuild()
ChatRequest.model_rebuild()
CompletionRequest.model_rebuild()


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int, exact: bool = True,
          recomputed_tokens: int = 0) -> dict:
    """OpenAI's usage object, counted as ``server/core/counts.py`` says: ``cached_tokens``: prompt
    tokens served from stored states (recomputed ones are not). Extension fields: ``exact`` (the
    prompt's state equals a plain prefill's; false: the answer is approximate) and
    ``recomputed_tokens`` (laid out from stored states, computed afresh)."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens},
            "exact": exact, "recomputed_tokens": recomputed_tokens}


def chat_response(rid: str, model: str, text: str | None, finish: str, use: dict, logprobs: dict | None = None,
                  tool_calls: list[dict] | None = None) -> dict:
    """A chat answer; ``tool_calls`` (OpenAI's shape) when the answer called tools."""
    message = {"role": "assistant", "content": text}
    if tool_calls:
        message["tool_calls"] = tool_calls
    return {"id": rid, "object": "chat.completion", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "message": message, "finish_reason": finish, "logprobs": logprobs}],
            "usage": use}


def chat_chunk(rid: str, model: str, delta: dict, finish: str | None = None, use: dict | None = None,
               logprobs: dict | None = None) -> dict:
    choices = [] if use is not None else [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": logprobs}]
    out = {"id": rid, "object": "chat.completion.chunk", "created": int(time.time()), "model": model,
           "choices": choices}
    if use is not None:
        out["usage"] = use
    return out


def completion_response(rid: str, model: str, text: str, finish: str, use: dict, logprobs: dict | None = None) -> dict:
    return {"id": rid, "object": "text_completion", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "text": text, "finish_reason": finish, "logprobs": logprobs}],
            "usage": use}


def completion_chunk(rid: str, model: str, text: str, finish: str | None = None, use: dict | None = None,
                     logprobs: dict | None = None) -> dict:
    choices = [] if use is not None else [{"index": 0, "text": text, "finish_reason": finish, "logprobs": logprobs}]
    out = {"id": rid, "object": "text_completion", "created": int(time.time()), "model": model, "choices": choices}
    if use is not None:
        out["usage"] = use
    return out


def parse(request: Request, cls: type[BaseModel], model_name: str | None = None):
    """The request body (parsed by ``limits.RequestGuard``) as ``cls``; APIError 400 naming the
    field at fault, 404 when ``model_name`` is given and the request names another model."""
    try:
        req = cls.model_validate(parsed_body(request.scope))
    except ValidationError as e:
        err = e.errors()[0]
        field = ".".join(str(x) for x in err["loc"]) or None
        msg = "is not supported by this server" if err["type"] == "extra_forbidden" else err["msg"]
        raise APIError(400, f"{field}: {msg}", field) from None
    if model_name is not None and req.model != model_name:
        raise APIError(404, f"model '{req.model}' does not exist (this server serves '{model_name}')",
                       "model", "model_not_found")
    return req
