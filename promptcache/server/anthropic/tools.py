"""Anthropic ``tools`` / ``tool_choice`` on ``/v1/messages``, on the OpenAI side's machinery.

Tools become OpenAI function specs (``input_schema`` is ``parameters``) for the model's chat
template, and need a template that supports them (``tools.unsupported``: Hermes ``<tool_call>``
blocks); ``tool_use`` blocks of the history become the assistant turn's ``tool_calls`` and each
``tool_result`` block a ``tool`` turn (its text; ``is_error`` puts ``Error: `` before it), in the
order the blocks come. Answers are parsed (``openai/toolcalls.py``) into ``tool_use`` blocks (ids
``toolu_...``, ``input`` the arguments object) after a text block when there was text;
``stop_reason`` is ``tool_use`` when the answer called tools.

``tool_choice``: ``auto`` (the default), ``any`` (calls only), ``tool`` (calls to ``name`` only)
and ``none`` (the tools are not rendered; nothing is parsed), constrained as ``tools.py`` says;
``disable_parallel_tool_use``: at most one call. A ``cache_control`` on a tool or a ``tool_use``
block is refused (no breakpoint can sit inside the template's tool list or a call's JSON); on a
``tool_result`` block it is a breakpoint after the result's text.
"""

from __future__ import annotations

import json

from pydantic import ValidationError

from . import protocol as A
from ..openai import tools
from ..core.errors import APIError
from ..openai.toolcalls import CallStream, ToolCall


def active(req: A.MessagesRequest) -> bool:
    return bool(req.tools) and (req.tool_choice is None or req.tool_choice.type != "none")


def check(req: A.MessagesRequest, tokenizer) -> None:
    """400 (Anthropic's shape) for tool fields this server cannot honour."""
    choice = req.tool_choice
    if choice is not None and not req.tools:
        raise A.AnthropicError(400, "tool_choice needs tools", "tool_choice")
    if not req.tools:
        return
    names = [t.name for t in req.tools]
    if len(set(names)) < len(names):
        raise A.AnthropicError(400, f"tool names must be unique, got {names}", "tools")
    for i, t in enumerate(req.tools):
        if t.cache_control is not None:
            raise A.AnthropicError(400, "cache_control on a tool is not supported (tools render inside the chat "
                                        "template); put the breakpoint on a system or message block",
                                   f"tools[{i}].cache_control")
    if choice is not None and (choice.type == "tool") != (choice.name is not None):
        raise A.AnthropicError(400, "tool_choice needs a name exactly when its type is 'tool'", "tool_choice.name")
    if choice is not None and choice.type == "tool" and choice.name not in names:
        raise A.AnthropicError(400, f"tool_choice names '{choice.name}', not one of the tools {names}",
                               "tool_choice.name")
    why = tools.unsupported(tokenizer)
    if why:
        raise A.AnthropicError(400, f"tools are not supported for this model: {why}", "tools")


def template_tools(req: A.MessagesRequest) -> list[dict] | None:
    """The tools as the chat template takes them (None: none, or tool_choice "none")."""
    if not active(req):
        return None
    return [{"type": "function", "function": {"name": t.name, **({"description": t.description} if t.description
                                                                   else {}), "parameters": t.input_schema}}
            for t in req.tools]


def processors(req: A.MessagesRequest, pc) -> tuple:
    if not active(req):
        return ()
    choice = req.tool_choice
    mode = "auto" if choice is None or choice.type == "auto" else "required" if choice.type == "any" else choice.name
    single = choice is not None and choice.disable_parallel_tool_use
    try:
        return tools.call_processor(pc, {t.name: t.input_schema for t in req.tools}, mode, single=single)
    except APIError as e:
        raise A.AnthropicError.of(e) from None


def block(raw: dict, role: str, where: str, tokenizer):
    """A ``tool_use`` (assistant) or ``tool_result`` (user) block, validated: the model instance."""
    kind = A.ToolUseBlock if raw.get("type") == "tool_use" else A.ToolResultBlock
    if (kind is A.ToolUseBlock) != (role == "assistant"):
        raise A.AnthropicError(400, f"a {raw.get('type')} block belongs in a "
                                    f"{'assistant' if kind is A.ToolUseBlock else 'user'} message", where)
    why = tools.unsupported(tokenizer)
    if why:
        raise A.AnthropicError(400, f"{raw.get('type')} blocks are not supported for this model: {why}", where)
    try:
        b = kind.model_validate(raw)
    except ValidationError as e:
        raise A.invalid(e, where) from None
    if kind is A.ToolUseBlock and b.cache_control is not None:
        raise A.AnthropicError(400, "cache_control on a tool_use block is not supported (put it on a text or "
                                    "tool_result block)", f"{where}.cache_control")
    return b


def call(b: A.ToolUseBlock) -> dict:
    """A ``tool_use`` block as a template's ``tool_calls`` entry."""
    return {"id": b.id, "type": "function", "function": {"name": b.name, "arguments": b.input}}


def result_text(b: A.ToolResultBlock) -> str:
    text = b.content if isinstance(b.content, str) else "".join(t.text for t in b.content)
    return "Error: " + text if b.is_error else text


def tool_use(c: ToolCall) -> dict:
    return {"type": "tool_use", "id": "toolu_" + c.id.removeprefix("call_"), "name": c.name,
            "input": json.loads(c.arguments)}


class ToolEvents:
    """A streamed answer's content-block events when it may call tools: text blocks and one
    ``tool_use`` block per call (its whole ``input`` in one ``input_json_delta``), indexed in order."""

    def __init__(self):
        self.calls = CallStream()
        self.index, self.text_open = -1, False

    def feed(self, text: str) -> list[str]:
        return self._events(self.calls.feed(text))

    def close(self) -> list[str]:
        """The last events; an answer of no text and no call has one empty text block, as when whole."""
        out = self._events(self.calls.close())
        if self.index < 0:
            self.index, self.text_open = 0, True
            out.append(A.event("content_block_start", {"index": 0, "content_block": {"type": "text", "text": ""}}))
        if self.text_open:
            out.append(A.event("content_block_stop", {"index": self.index}))
        return out

    def _events(self, pieces) -> list[str]:
        out = []
        for p in pieces:
            if isinstance(p, str):
                if not self.text_open:
                    self.index, self.text_open = self.index + 1, True
                    out.append(A.event("content_block_start", {"index": self.index,
                                                               "content_block": {"type": "text", "text": ""}}))
                out.append(A.event("content_block_delta", {"index": self.index,
                                                           "delta": {"type": "text_delta", "text": p}}))
                continue
            if self.text_open:
                out.append(A.event("content_block_stop", {"index": self.index}))
            self.index, self.text_open = self.index + 1, False
            use = tool_use(p)
            out += [A.event("content_block_start", {"index": self.index, "content_block": {**use, "input": {}}}),
                    A.event("content_block_delta", {"index": self.index, "delta": {
                        "type": "input_json_delta", "partial_json": p.arguments}}),
                    A.event("content_block_stop", {"index": self.index})]
        return out
