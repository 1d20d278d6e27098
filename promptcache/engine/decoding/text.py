"""Incremental detokenization with stop strings: token ids in, text pieces out."""

from __future__ import annotations

from typing import Iterable

__all__ = ["TextStream", "concatenates"]


def concatenates(tokenizer) -> bool:
    """Whether decoding ``a + b`` gives decode(a) + decode(b) wherever decode(a) ends with a whole
    character: a fast tokenizer whose decoder is byte-level alone (GPT-2's: each token's bytes
    joined, then read as UTF-8, which resynchronizes after a whole character) with no clean-up of
    spaces (a rule across the join). Others (SentencePiece's strip of a leading space, WordPiece's
    joins, the clean-up) do not."""
    decoder = type(getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None))
    # the tokenizers library's class (what transformers' fast tokenizers run), named, not imported:
    # it is transformers' dependency, not this package's
    return (decoder.__module__, decoder.__name__) == ("tokenizers.decoders", "ByteLevel") \
        and getattr(tokenizer, "clean_up_tokenization_spaces", True) is False


class TextStream:
    """Turns a growing list of token ids into text pieces; applies stop strings.

    Holds back text that is an incomplete UTF-8 sequence or could still become a stop string.

    Where the tokenizer's decoding ``concatenates``, the ids up to the last whole character are
    decoded once (``settled``) and each push decodes only the ids after them (one token, mostly), and
    looks for stop strings only where they could reach the new text: the same pieces and text as
    decoding every id again at each token, whose cost grows with the generation, for every row of
    every decode step (48 rows over 300 steps: 3.4 -> 0.37 ms a step of picking, stop checks and
    text, eval/results/host_overhead.md).
    """

    def __init__(self, tokenizer, stop: Iterable[str] | None = None):
        self.tok = tokenizer
        self.stop = [s for s in (stop or []) if s]
        self.ids: list[int] = []
        self.sent = 0  # characters already handed out
        self.text = ""
        self.stopped = False
        # ids whose text is final and its text (None: every push decodes every id)
        self.settled: int | None = 0 if concatenates(tokenizer) else None
        self.settled_text = ""
        # where decoding concatenates, transformers' ``decode`` is the backend tokenizer's with nothing
        # after it (no clean-up): that, called directly, without the wrapper's conversions (a push a
        # row a decode step)
        self._tail = tokenizer.backend_tokenizer.decode if self.settled is not None else None

    def push(self, token_id: int) -> str:
        self.ids.append(token_id)
        fixed = 0  # leading characters no earlier push's text differed in (none held a stop string)
        if self.settled is None:
            text = self.tok.decode(self.ids, skip_special_tokens=True)
        else:
            fixed = len(self.settled_text)
            tail = self._tail(self.ids[self.settled :], skip_special_tokens=True)
            text = self.settled_text + tail
            if not tail.endswith("\ufffd"):  # a whole character last: later bytes cannot change it
                self.settled, self.settled_text = len(self.ids), text
        for s in self.stop:  # a stop string found now reaches past the fixed text
            at = text.find(s, max(0, fixed - len(s) + 1))
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
