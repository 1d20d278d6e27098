"""An Anthropic Messages request -> prompt token IDs and its ``cache_control`` breakpoints.

The conversation is rendered with the model's chat template, in the API's order: ``tools``
(the template places them), ``system`` (its text blocks joined into one system turn), then
``messages`` (``tool_use`` / ``tool_result`` blocks as ``tools.py`` says). A last ``assistant``
message is a prefill: the answer continues it (``continue_final_message``) instead of starting a
new turn.

Breakpoints: a text block with ``cache_control`` caches "the prompt up to and including this
block"; a top-level ``cache_control`` marks the last block of the last message. Its place in tokens is found without trusting the template to be prefix-stable: the
conversation is rendered once plainly (text ``T``, token IDs ``ids``) and once per breakpoint with
a marker right after the block's text; the breakpoint is at the marker's character offset, cut
back to where the two renderings still agree (a template that trims content moves it back, never
forward), and then to the longest run of ``ids`` that tokenizing ``T`` up to there reproduces.
So a breakpoint's token count is always a true prefix of the prompt's IDs.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass

from pydantic import ValidationError

from . import tools as anthropic_tools
from .protocol import MAX_BREAKPOINTS, TTL_SECONDS, AnthropicError, MessagesRequest, TextBlock, invalid


@dataclass(frozen=True)
class Breakpoint:
    tokens: int  # prompt tokens [0, tokens) before the breakpoint: the prefix it caches
    ttl: float  # seconds
    where: str  # the block, e.g. "messages[1].content[0]"


@dataclass(frozen=True)
class RenderedPrompt:
    ids: list[int]
    breakpoints: list[Breakpoint]  # in prompt order


@dataclass(frozen=True)
class _Block:
    text: str
    ttl: float | None  # None: no cache_control
    where: str


def render(tok, req: MessagesRequest) -> RenderedPrompt:
    """Token IDs of ``req``'s conversation (plus the generation prompt) and its breakpoints."""
    turns = _turns(req, tok)
    marked = [b for t in turns for b in t.blocks if b.ttl is not None]
    if len(marked) > MAX_BREAKPOINTS:
        raise AnthropicError(400, f"a request may have at most {MAX_BREAKPOINTS} blocks with cache_control, "
                                  f"got {len(marked)}", marked[MAX_BREAKPOINTS].where)
    functions = anthropic_tools.template_tools(req)
    text = _chat_text(tok, turns, None, functions)
    ids = _encode(tok, text)
    points = [Breakpoint(_tokens_before(tok, text, ids, _chat_text(tok, turns, b, functions)), b.ttl, b.where)
              for b in marked]
    return RenderedPrompt(ids, points)


@dataclass
class _Turn:
    role: str  # the template's: system, user, assistant, tool
    blocks: list[_Block]
    extra: dict  # the template's other keys: tool_calls (assistant), tool_call_id (tool)


def _turns(req: MessagesRequest, tok) -> list[_Turn]:
    """Turns in the API's order: system, then the messages (a tool_result block is a turn of its own)."""
    turns = []
    if isinstance(req.system, str) and req.system:
        turns.append(_Turn("system", [_Block(req.system, None, "system")], {}))
    elif isinstance(req.system, list) and req.system:
        turns.append(_Turn("system", [_block(b, f"system[{j}]") for j, b in enumerate(req.system)], {}))
    for i, m in enumerate(req.messages):
        if isinstance(m.content, str):
            turns.append(_Turn(m.role, [_Block(m.content, None, f"messages[{i}].content")], {}))
            continue
        turns += _message_turns(m.role, m.content, i, tok)
    if req.cache_control is not None:  # top level: the last block caches too (a longer TTL wins)
        blocks = turns[-1].blocks
        if not blocks:  # an assistant turn of calls only: the breakpoint follows its (empty) text
            blocks.append(_Block("", None, f"messages[{len(req.messages) - 1}]"))
        last, ttl = blocks[-1], float(TTL_SECONDS[req.cache_control.ttl])
        blocks[-1] = _Block(last.text, max(ttl, last.ttl or 0.0), last.where)
    return turns


def _message_turns(role: str, content: list[dict], i: int, tok) -> list[_Turn]:
    """The turns of one message's blocks: text blocks gather into turns of ``role``; each
    ``tool_result`` is a ``tool`` turn; ``tool_use`` blocks are the assistant turn's calls."""
    turns, current = [], _Turn(role, [], {})
    for j, raw in enumerate(content):
        where = f"messages[{i}].content[{j}]"
        kind = raw.get("type")
        if kind == "text":
            try:
                current.blocks.append(_block(TextBlock.model_validate(raw), where))
            except ValidationError as e:
                raise invalid(e, where) from None
        elif kind in ("tool_use", "tool_result"):
            b = anthropic_tools.block(raw, role, where, tok)
            if kind == "tool_use":
                current.extra.setdefault("tool_calls", []).append(anthropic_tools.call(b))
                continue
            if current.blocks:
                turns.append(current)
                current = _Turn(role, [], {})
            ttl = None if b.cache_control is None else float(TTL_SECONDS[b.cache_control.ttl])
            turns.append(_Turn("tool", [_Block(anthropic_tools.result_text(b), ttl, where)],
                               {"tool_call_id": b.tool_use_id}))
        else:
            raise AnthropicError(400, f"content block type {kind!r} is not supported (text, tool_use and "
                                      "tool_result)", where)
    if current.blocks or current.extra or not turns:
        turns.append(current)
    return turns


def _block(b: TextBlock, where: str) -> _Block:
    ttl = None if b.cache_control is None else float(TTL_SECONDS[b.cache_control.ttl])
    return _Block(b.text, ttl, where)


_MARK = f"\ue000{uuid.uuid4().hex}\ue001"  # a private-use sentinel no request text carries


def _chat_text(tok, turns: list[_Turn], mark: _Block | None, functions: list[dict] | None) -> str:
    """The rendered conversation; with ``mark``, the sentinel follows that block's text;
    ``functions``: OpenAI tool specs for the template (None: none)."""
    msgs = [{"role": t.role, "content": "".join(b.text + (_MARK if b is mark else "") for b in t.blocks), **t.extra}
            for t in turns]
    prefill = msgs[-1]["role"] == "assistant"
    if not getattr(tok, "chat_template", None):
        text = "".join(f"{m['role'].capitalize()}: {m['content']}\n" for m in msgs)
        return text.rstrip("\n") if prefill else text + "Assistant:"
    try:
        return tok.apply_chat_template(msgs, tools=functions, tokenize=False, add_generation_prompt=not prefill,
                                       continue_final_message=prefill)
    except Exception as e:  # templates raise on role orders they refuse
        raise AnthropicError(400, f"the model's chat template refused the messages: {e}", "messages") from None


def _encode(tok, text: str) -> list[int]:
    return list(tok(text, add_special_tokens=False).input_ids)  # the template writes BOS itself


def _tokens_before(tok, text: str, ids: list[int], marked: str) -> int:
    """Tokens of ``ids`` that lie before the sentinel in ``marked`` (see the module docstring)."""
    at = marked.find(_MARK)
    if at < 0:  # the template dropped the block's text (and the sentinel with it)
        return 0
    agree = next((i for i, (a, b) in enumerate(zip(text, marked[:at])) if a != b), min(len(text), at))
    head = _encode(tok, text[:agree])
    return next((i for i, (a, b) in enumerate(zip(head, ids)) if a != b), min(len(head), len(ids)))
