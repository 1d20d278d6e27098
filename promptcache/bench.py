"""The TTFT benchmark behind ``promptcache bench`` and ``eval/bench_engine.py``.

One process, one model, one prompt: full prefill (ordinary KV cache) vs Prompt Cache, four ways
(the first prompt of a fresh engine; fresh buffer; reused buffer, every module copied; modules
already in place) vs the true limit: the forward of the new tokens alone on an already assembled,
preallocated cache, computing logits for the last token only (no concatenation, no copy).
Medians after a warm-up. Encoding is timed against one plain prefill of the same tokens.

The first prompt of a fresh engine (a new ``PromptCache`` on the same loaded model, which
encodes the schema and then serves the prompt once) finds its modules already in place: the
engine places the schema's default pass into a prewarmed buffer at registration (on CPU), so
that prompt pays the forward and the planning, not a copy of every module.
"""

from __future__ import annotations

import logging
import random
import statistics
import time
from dataclasses import dataclass
from typing import Callable

import torch

WORDS = (
    "the city river museum market train temple garden bridge harbour castle street night food music "
    "ancient modern quiet busy famous small large old new north south east west travel visit walk see "
    "history art coffee bread tea fish rice noodle wine cheese park square tower church palace island "
    "mountain valley lake beach forest village road station ticket hotel room morning evening summer"
).split()

log = logging.getLogger(__name__)


def sentences(n_words: int, seed: int) -> str:
    """Deterministic filler text of about ``n_words`` words."""
    rng = random.Random(seed)
    out, words = [], 0
    while words < n_words:
        k = rng.randint(6, 14)
        s = " ".join(rng.choice(WORDS) for _ in range(k))
        out.append(s[0].upper() + s[1:] + ".")
        words += k
    return " ".join(out)


def median_time(fn, repeats: int, warmup: int = 1) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def build_schema(tok, target_tokens: int, modules: int = 8) -> str:
    """A schema of a system prompt and ``modules`` documents totalling about ``target_tokens``."""
    per = max(1, target_tokens // modules)
    docs = []
    for i in range(modules):
        words = per
        text = sentences(words, seed=100 + i)
        while len(tok.encode(text, add_special_tokens=False)) > per and words > 1:
            words = int(words * 0.9)
            text = sentences(words, seed=100 + i)
        docs.append(f'<module name="doc{i}">{text}</module>')
    return f'<schema name="bench"><system>{sentences(40, seed=1)}</system><user>{"".join(docs)}</user></schema>'


def build_prompt(pc, modules: int, new_tokens: int) -> str:
    """A prompt importing every document, with free text making ``new_tokens`` new tokens in all."""
    refs = "".join(f"<doc{i}/>" for i in range(modules))
    glue = sum(len(s) for s in pc.layout(f'<prompt schema="bench">{refs}</prompt>').new)  # chat template tail
    ids = pc.tokenizer.encode(sentences(new_tokens, seed=7), add_special_tokens=False)
    for n in range(max(new_tokens - glue, 1), 0, -1):  # a decoded cut may re-tokenize longer
        prompt = f'<prompt schema="bench">{refs} {pc.tokenizer.decode(ids[:n])}</prompt>'
        if sum(len(s) for s in pc.layout(prompt).new) <= new_tokens:
            return prompt
    return prompt


@dataclass
class BenchResult:
    cached_tokens: int
    new_tokens: int
    encode_s: float
    full_s: float
    first_s: float
    cold_s: float
    copy_s: float
    inplace_s: float
    limit_s: float
    layout_s: float
    bytes_copied_all: int
    bytes_per_token: float
    theory_bytes_per_token: int
    encode_plain_s: float = 0.0  # one plain prefill of the schema's tokens (what encoding is held to)
    kv_dtype: str = "float32"

    def lines(self) -> list[str]:
        out = [f"{self.cached_tokens} cached + {self.new_tokens} new tokens; schema encoded once in "
               f"{self.encode_s:.2f} s ({self.encode_s / self.encode_plain_s:.2f}x one plain prefill of its "
               f"tokens, {self.encode_plain_s:.2f} s)",
               f"TTFT full prefill:                            {self.full_s * 1e3:8.1f} ms"]
        for label, t in (("first prompt of a fresh engine", self.first_s),
                         ("fresh buffer, every module copied", self.cold_s),
                         ("reused buffer, every module copied", self.copy_s),
                         ("modules already in place", self.inplace_s)):
            out.append(f"TTFT Prompt Cache, {label:35s} {t * 1e3:8.1f} ms  {self.full_s / t:6.1f}x faster, "
                       f"{t / self.limit_s:.2f}x the limit")
        out += [f"TTFT limit (new tokens on an assembled, preallocated cache, last-token logits): "
                f"{self.limit_s * 1e3:8.1f} ms",
                f"  parse + layout per prompt:                  {self.layout_s * 1e3:8.2f} ms",
                f"  copying every module: {self.bytes_copied_all / 2**20:.1f} MiB",
                f"stored bytes per token ({self.kv_dtype}): {self.bytes_per_token:.0f} "
                f"(theory {self.theory_bytes_per_token}, "
                f"{100 * (self.bytes_per_token / self.theory_bytes_per_token - 1):+.2f}%)"]
        return out


def first_prompt(pc, schema: str, prompt: str) -> float:
    """TTFT of the first prompt of a fresh engine on ``pc``'s model (it encodes the schema first)."""
    fresh = type(pc)(pc.model, pc.tokenizer, pc.config)
    fresh.add_schema(schema)
    ttft = fresh.prefill(prompt).ttft
    fresh.clear_buffers()
    return ttft


def run(pc, schema_tokens: int = 2000, new_tokens: int = 32, repeats: int = 10,
        announce: Callable[[str], None] | None = None) -> BenchResult:
    """Benchmark a PromptCache (its model and tokenizer) on a synthetic schema. ``announce(step)``
    is called as each step starts (default: an INFO log line), so long runs are never silent."""
    say = announce or (lambda step: log.info("bench: %s", step))
    say(f"encoding a {schema_tokens}-token schema")
    schema = build_schema(pc.tokenizer, schema_tokens)
    t0 = time.perf_counter()
    entry = pc.add_schema(schema)
    encode_s = time.perf_counter() - t0
    schema_ids = [t for i in entry.default_order() for t in entry.layout.spans[i].token_ids]
    encode_plain_s = median_time(lambda: pc.runner.prefill_plain(schema_ids), repeats=1, warmup=0)
    prompt = build_prompt(pc, 8, new_tokens)
    say("timing the first prompt of a fresh engine")
    t_first = first_prompt(pc, schema, prompt)
    first = pc.prefill(prompt)
    sync = torch.cuda.synchronize if pc.device.type == "cuda" else (lambda: None)

    def cold():
        pc.clear_buffers()
        return pc.prefill(prompt)

    def copy_all():
        pc.forget_placement()
        return pc.prefill(prompt)

    say(f"timing full prefill ({max(3, repeats // 3)} repeats)")
    full = median_time(lambda: pc.prefill_baseline(prompt), repeats=max(3, repeats // 3))
    say(f"timing Prompt Cache, fresh buffer ({repeats} repeats)")
    t_cold = median_time(cold, repeats)
    say(f"timing Prompt Cache, reused buffer ({repeats} repeats)")
    t_copy = median_time(copy_all, repeats)
    copied = copy_all().bytes_copied
    say(f"timing Prompt Cache, modules in place ({repeats} repeats)")
    t_in = median_time(lambda: pc.prefill(prompt), repeats)
    kept = pc.prefill(prompt, keep_cache=True)
    new = kept.layout.new
    ids = torch.tensor([[t for s in new for t in s.token_ids]], device=pc.device)
    pos = torch.tensor([[p for s in new for p in s.position_ids]], device=pc.device)

    def limit():
        kept.cache.set_length(first.cached_tokens)
        pc.adapter.forward(ids, pos, kept.cache)
        sync()

    say(f"timing the limit ({repeats} repeats)")
    t_limit = median_time(limit, repeats)
    pc.release(kept)
    t_layout = median_time(lambda: pc.layout(prompt), repeats)
    stored = [pc.store.get(k)[0] for k in entry.keys.values()]
    measured = sum(t.numel() * t.element_size() for t in stored) / entry.stored_tokens  # what the store holds
    return BenchResult(first.cached_tokens, first.new_tokens, encode_s, full, t_first, t_cold, t_copy, t_in,
                       t_limit, t_layout, copied, measured, entry.bytes_per_token, encode_plain_s,
                       str(pc.runner.stored_spec.dtype).removeprefix("torch."))
