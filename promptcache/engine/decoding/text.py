"""Incremental detokenization with stop strings: token ids in, text pieces out."""

from __future__ import annotations

from typing import Iterable

__all__ = ["TextStream"]


class TextStream:
    """Turns a growing list of token ids into text pieces; applies stop strings.

    Holds back text that is an incomplete UTF-8 sequence or could still become a stop string.
    """

    def __init__(self, tokenizer, stop: Iterable[str] | None = None):
        self.tok = tokenizer
        self.stop = [s for s in (stop or []) if s]
        self.ids: list[int] = []
        self.sent = 0  # characters already handed out
        self.text = ""
        self.stopped = False

    def push(self, token_id: int) -> str:
        self.ids.append(token_id)
        text = self.tok.decode(self.ids, skip_special_tokens=True)
        for s in self.stop:
            at = text.find(s)
            if at >= 0:
                text, self.stopped = text[:at], True
        self.text = text
        safe = len(text)
        if not self.stopped:
            if text.endswith("\ufffd"):
                safe = len(text.rstrip("\ufffd"))
            for s in self.stop:  # keep back a tail that may start a stop string
                for k in range(min(len(s) - 1, safe), 0, -1):
                    if s.startswith(text[safe - k : safe]):
                        safe -= k
                        break
        piece = text[self.sent : safe] if safe > self.sent else ""
        self.sent = max(self.sent, safe)
        return piece

    def flush(self) -> str:
        piece = self.text[self.sent :]
        self.sent = len(self.text)
        return piece
