"""OpenAI ``tools``, ``tool_choice`` and ``parallel_tool_calls`` on chat requests.

Tools go through the model's own chat template (``apply_chat_template(..., tools=[...])`` with
the request's function specs as sent) and its calls are parsed from the answer
(``toolcalls.py``). A template "supports tools" when all of these hold, else a request with
``tools`` is a 400 naming ``tools`` that says which one failed: the template's source uses
``tools``; rendering a probe tool changes the prompt; a probe call in the history renders as
``<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>``, the one call format parsed
(Hermes / Qwen2.5 / Qwen3; Qwen3-Coder's ``<function=...>`` inside the tag is another format).
A history with assistant ``tool_calls`` or ``tool`` messages needs such a template too.

``tool_choice``:
  * ``"none"``: the prompt is rendered WITHOUT the tools and the answer is not parsed: plain text.
  * ``"auto"`` (the default with tools): free text; once the model writes ``<tool_call>`` the
    call is constrained (xgrammar, ``engine.decoding.constrained.tags_processor``) to one of the tools'
    names with arguments valid against its ``parameters`` schema.
  * ``"required"``: the answer is only calls (one or more) to the tools, constrained likewise;
    ``{"type": "function", "function": {"name": N}}``: only calls to N.
``parallel_tool_calls: false``: at most one call (the grammar ends after the first); true or
absent: any number. Calls are written as the templates render them: ``<tool_call>\\n`` + compact
JSON + ``\\n</tool_call>``, ``\\n`` between calls, so a history sent back renders the same text.
A tool without ``parameters`` takes any JSON object. ``response_format`` other than text
together with tools (unless "none") is refused: one answer cannot follow both grammars.
"""

from __future__ import annotations

import functools
import json

from ...engine.decoding.constrained import ConstraintError, Tag, tags_processor
from ..core.errors import APIError
from .protocol import ChatRequest, Message
from .toolcalls import BEGIN, END

CALL_BEGIN, CALL_END, SEPARATOR = BEGIN + "\n", "\n" + END, "\n"
_PROBE = [{"type": "function", "function": {"name": "probe_tool_support", "description": "A probe.",
                                            "parameters": {"type": "object", "properties": {}}}}]


def active(req: ChatRequest) -> bool:
    """The request has tools the model is shown (and its answer is parsed for calls)."""
    return bool(req.tools) and req.tool_choice != "none"


def check(req: ChatRequest, tokenizer) -> None:
    """400 for tool fields this server cannot honour (before anything is rendered)."""
    if req.tool_choice is not None and not req.tools:
        raise APIError(400, "tool_choice needs tools", "tool_choice")
    if req.tools:
        names = [t.function.name for t in req.tools]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise APIError(400, f"tool names must be unique, {dup} repeat", "tools")
        if not isinstance(req.tool_choice, str) and req.tool_choice is not None \
                and req.tool_choice.function.name not in names:
            raise APIError(400, f"tool_choice names '{req.tool_choice.function.name}', not one of the tools {names}",
                           "tool_choice")
        if active(req) and req.response_format is not None and req.response_format.type != "text":
            raise APIError(400, "response_format cannot be combined with tools (unless tool_choice is 'none')",
                           "response_format")
        why = unsupported(tokenizer)
        if why:
            raise APIError(400, f"tools are not supported for this model: {why}", "tools")


def check_history(messages: list[Message], tokenizer) -> None:
    """400 for tool calls or tool answers in a history the chat template cannot render."""
    for i, m in enumerate(messages):
        if m.tool_calls or m.role == "tool":
            why = unsupported(tokenizer)
            if why:
                field = f"messages[{i}]" + (".tool_calls" if m.tool_calls else "")
                raise APIError(400, f"{field}: tool calls in the history are not supported for this model: {why}",
                               field)


def unsupported(tokenizer) -> str | None:
    """Why the tokenizer's chat template cannot serve tools (None: it can)."""
    return _unsupported(tokenizer, getattr(tokenizer, "chat_template", None))


@functools.lru_cache(maxsize=8)
def _unsupported(tokenizer, template) -> str | None:
    if not isinstance(template, str):
        return "the model has no chat template (or several named ones)"
    if "tools" not in template:
        return "its chat template does not use 'tools'"
    msgs = [{"role": "user", "content": "hi"}]
    try:
        plain = tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
        probed = tokenizer.apply_chat_template(msgs, tools=_PROBE, tokenize=False, add_generation_prompt=True)
    except Exception as e:  # a template that raises on tools cannot serve them
        return f"its chat template failed on a probe tool: {e}"
    if plain == probed:
        return "its chat template renders nothing for a probe tool"
    call = {"id": "call_probe", "type": "function", "function": {"name": "probe_tool_support", "arguments": {"n": 1}}}
    history = msgs + [{"role": "assistant", "content": "", "tool_calls": [call]},
                      {"role": "tool", "content": "ok", "tool_call_id": "call_probe"}]
    expected = CALL_BEGIN + '{"name": "probe_tool_support", "arguments": {"n": 1}}' + CALL_END
    try:
        rendered = tokenizer.apply_chat_template(history, tools=_PROBE, tokenize=False)
    except Exception as e:
        return f"its chat template failed on a probe tool call: {e}"
    if expected not in rendered:
        return (f"its chat template writes tool calls in a format this server does not parse (only "
                f"{expected!r} blocks)")
    return None


def template_tools(req: ChatRequest) -> list[dict] | None:
    """The tools the chat template renders (None: no tools, or ``tool_choice`` "none")."""
    return [t.model_dump(exclude_none=True) for t in req.tools] if active(req) else None


def history(m: Message, i: int, content: str) -> dict:
    """A request message as the template's dict, its tool calls' arguments as objects (the templates
    write ``arguments | tojson``)."""
    if m.tool_call_id is not None and m.role != "tool":
        raise APIError(400, f"tool_call_id belongs on role 'tool' messages, messages[{i}] is '{m.role}'",
                       f"messages[{i}].tool_call_id")
    if m.tool_calls and m.role != "assistant":
        raise APIError(400, f"tool_calls belong on assistant messages, messages[{i}] is '{m.role}'",
                       f"messages[{i}].tool_calls")
    if m.role == "tool":
        if m.tool_call_id is None:
            raise APIError(400, f"messages[{i}] (role 'tool') needs tool_call_id", f"messages[{i}].tool_call_id")
        return {"role": "tool", "content": content, "tool_call_id": m.tool_call_id}
    out = {"role": "system" if m.role == "developer" else m.role, "content": content}
    if m.tool_calls:
        out["tool_calls"] = [_call(c, f"messages[{i}].tool_calls[{j}]") for j, c in enumerate(m.tool_calls)]
    return out


def _call(c, where: str) -> dict:
    try:
        args = json.loads(c.function.arguments)
    except ValueError as e:
        raise APIError(400, f"{where}.function.arguments is not JSON: {e}", f"{where}.function.arguments") from None
    if not isinstance(args, dict):
        raise APIError(400, f"{where}.function.arguments must be a JSON object", f"{where}.function.arguments")
    return {"id": c.id, "type": "function", "function": {"name": c.function.name, "arguments": args}}


def processors(req: ChatRequest, pc) -> tuple:
    """The logits processor that makes calls follow the tools' schemas (empty without tools)."""
    if not active(req):
        return ()
    choice = req.tool_choice or "auto"
    functions = {t.function.name: t.function.parameters for t in req.tools}
    return call_processor(pc, functions, choice if isinstance(choice, str) else choice.function.name,
                          single=req.parallel_tool_calls is False)


def call_processor(pc, functions: dict[str, dict | None], choice: str, *, single: bool,
                   param: str = "tools") -> tuple:
    """The processor for calls to ``functions`` (name -> parameters schema; None: any object).
    ``choice``: "auto" (text or calls), "required" (calls only) or a name (calls to it only)."""
    if choice not in ("auto", "required"):
        functions = {choice: functions[choice]}
    tags = [Tag(f'{CALL_BEGIN}{{"name": "{name}", "arguments": ', schema if schema is not None else {"type": "object"},
                "}" + CALL_END) for name, schema in functions.items()]
    try:
        return (tags_processor(pc.tokenizer, pc.model.config.vocab_size, tags, separator=SEPARATOR, trigger=BEGIN,
                               required=choice != "auto", single=single),)
    except ConstraintError as e:
        raise APIError(400, str(e), param) from None
    except ImportError as e:
        raise APIError(400, f"tools are not available on this server: {e}", param) from None
