"""Tiny tokenizers for the language tests (no torch, no downloads).

``ToyTokenizer`` makes token counts easy to compute by hand: one token per run of
non-whitespace characters, with the whitespace before it attached ("Plan a trip." is 3 tokens,
" days." is 1). Whitespace alone is no token. Ids are assigned on first sight, from 2.
"""

import re


class ToyTokenizer:
    pad_id = 0
    _WORD = re.compile(r"\s*\S+")

    def __init__(self, bos: bool = False):
        self.bos_ids = (1,) if bos else ()
        self.vocab: dict[str, int] = {}

    def encode(self, text: str) -> list[int]:
        return [self.vocab.setdefault(w, len(self.vocab) + 2) for w in self._WORD.findall(text)]

    def decode(self, ids) -> str:
        inv = {v: k for k, v in self.vocab.items()}
        return "".join(inv.get(i, f"<{i}>") for i in ids)
