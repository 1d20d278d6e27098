"""Tool calls in generated text: the Hermes / Qwen2.5 format, parsed whole or while streaming.

The one format recognised (Hermes, used by Qwen2.5, Qwen3, Hermes 2/3 and the templates derived
from them)::

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

one block per call, any text around them. ``parse(text)`` splits a finished answer into its
content and its calls; ``CallStream`` does the same piece by piece for a streamed answer.

Decisions:
  * A block whose inside is not a JSON object with a string ``name`` and an object ``arguments``
    (malformed JSON, a missing key) is not a call: it stays in the content, tags included, and is
    logged, so the client sees what the model wrote rather than losing it.
  * A block left open at the end (the model stopped before or within ``</tool_call>``) is a call
    when its inside is a whole call object; otherwise it is content like any malformed block.
  * Content is the text outside the calls with the whitespace at its ends stripped (the template
    separates calls with newlines); no text at all is ``None``, as OpenAI answers.
  * Call ids are ``call_`` and 24 hex digits; ``arguments`` is the JSON text of the object
    (compact separators as ``json.dumps`` writes them).
"""

from __future__ import annotations

import json
import logging
import uuid
from dataclasses import dataclass

log = logging.getLogger(__name__)

BEGIN, END = "<tool_call>", "</tool_call>"


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # a JSON object's text

    def openai(self, index: int | None = None) -> dict:
        """The OpenAI shape (``message.tool_calls[i]``; with ``index``: a streamed delta's)."""
        out = {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}
        return out if index is None else {"index": index, **out}


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


def call_of(inside: str) -> ToolCall | None:
    """The call a block's inside holds (None: not a call object, logged)."""
    try:
        obj = json.loads(inside)
    except ValueError as e:
        log.warning("a <tool_call> block is not JSON (%s); kept as content: %.200r", e, inside)
        return None
    if not (isinstance(obj, dict) and isinstance(obj.get("name"), str) and isinstance(obj.get("arguments"), dict)):
        log.warning("a <tool_call> block is not {\"name\": str, \"arguments\": object}; kept as content: %.200r", inside)
        return None
    return ToolCall(new_call_id(), obj["name"], json.dumps(obj["arguments"], ensure_ascii=False))


def parse(text: str) -> tuple[str | None, list[ToolCall]]:
    """(content, calls) of a finished answer."""
    stream = CallStream()
    content = "".join(p for p in stream.feed(text) + stream.close() if isinstance(p, str))
    return content or None, stream.calls


def finish_reason(reason: str, calls: list[ToolCall]) -> str:
    """OpenAI's finish reason of an answer that called tools: ``tool_calls`` (a cut-off stays ``length``)."""
    return "tool_calls" if calls and reason == "stop" else reason


def openai_deltas(pieces: list, stream: "CallStream") -> list[dict]:
    """OpenAI chat deltas of ``stream``'s pieces: content text, or one tool call with its index."""
    return [{"content": p} if isinstance(p, str) else {"tool_calls": [p.openai(stream.calls.index(p))]}
            for p in pieces]


class CallStream:
    """Feeds text pieces, yields what may be sent: ``str`` (content) and ``ToolCall`` items.

    Text that may be the start of ``<tool_call>`` is held back until the next piece says whether
    it is; a block is held until ``</tool_call>`` closes it. Whitespace is held until text follows
    it, so the content pieces put together are the stripped content ``parse`` returns."""

    def __init__(self):
        self.buffer = ""  # held text: a possible tag start, or a whole open block (from BEGIN)
        self.spaces = ""  # whitespace at the end of the content sent so far, held
        self.sent = False  # some content was sent (whitespace before it is dropped)
        self.calls: list[ToolCall] = []

    def feed(self, text: str) -> list:
        self.buffer += text
        out = []
        while True:
            if self.buffer.startswith(BEGIN):
                end = self.buffer.find(END, len(BEGIN))
                if end < 0:
                    return out
                block, self.buffer = self.buffer[: end + len(END)], self.buffer[end + len(END):]
                out += self._block(block, block[len(BEGIN):end])
                continue
            at = self.buffer.find(BEGIN)
            keep = at if at >= 0 else len(self.buffer) - _partial(self.buffer, BEGIN)
            if keep > 0:
                out += self._content(self.buffer[:keep])
                self.buffer = self.buffer[keep:]
            if at < 0:
                return out

    def close(self) -> list:
        """What is still held, at the end of the answer (an open block may still be a call)."""
        held, self.buffer = self.buffer, ""
        inside = held[len(BEGIN):]
        inside = inside[: len(inside) - _partial(inside, END)]
        if held.startswith(BEGIN) and inside.strip():
            return self._block(held, inside)
        return self._content(held)

    def _block(self, block: str, inside: str) -> list:
        call = call_of(inside)
        if call is None:
            return self._content(block)
        self.calls.append(call)
        return [call]

    def _content(self, text: str) -> list:
        body = text.rstrip()
        if not body.strip():  # whitespace only: held (dropped before any content and at the end)
            self.spaces += text if self.sent else ""
            return []
        if not self.sent:
            body, self.sent = body.lstrip(), True
        out, self.spaces = [self.spaces + body], text[len(text.rstrip()):]
        return out


def _partial(text: str, tag: str) -> int:
    """Length of the longest end of ``text`` that is a proper start of ``tag`` (0 if none)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0
