"""Token choice and incremental text decoding for the generation loop."""

from __future__ import annotations

from typing import Callable, Iterable, Iterator

import torch

Sampler = Callable[[torch.Tensor], int]


def make_sampler(temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0, seed: int | None = None) -> Sampler:
    """Greedy when temperature <= 0; otherwise temperature, then top-k, then top-p (nucleus)."""
    if temperature < 0 or not 0 < top_p <= 1 or top_k < 0:
        raise ValueError(f"bad sampling settings: temperature={temperature}, top_p={top_p}, top_k={top_k}")
    if temperature == 0:
        return lambda logits: int(torch.argmax(logits))
    gen = torch.Generator()
    if seed is not None:
        gen.manual_seed(seed)
    else:
        gen.seed()

    def sample(logits: torch.Tensor) -> int:
        x = logits.detach().float().cpu() / temperature  # [V]
        if top_k > 0 and top_k < x.numel():
            kth = torch.topk(x, top_k).values[-1]
            x = x.masked_fill(x < kth, float("-inf"))
        if top_p < 1.0:
            probs, order = torch.sort(torch.softmax(x, -1), descending=True)
            drop = torch.cumsum(probs, -1) - probs >= top_p  # keep the smallest set reaching top_p
            x[order[drop]] = float("-inf")
        return int(torch.multinomial(torch.softmax(x, -1), 1, generator=gen))

    return sample


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


def eos_ids(model, tokenizer) -> set[int]:
    ids = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if ids is None:
        ids = tokenizer.eos_token_id
    if ids is None:
        return set()
    return {ids} if isinstance(ids, int) else set(ids)


def decode_loop(first_logits: torch.Tensor, step: Callable[[int], torch.Tensor], sampler: Sampler,
                max_new_tokens: int, stop_ids: set[int]) -> Iterator[int]:
    """Yield up to ``max_new_tokens`` token ids; ``step(token)`` runs one token, returns logits."""
    logits = first_logits
    for i in range(max_new_tokens):
        tok = sampler(logits)
        yield tok
        if tok in stop_ids or i == max_new_tokens - 1:
            return
        logits = step(tok)
