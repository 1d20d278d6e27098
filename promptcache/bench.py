"""The TTFT benchmark behind ``promptcache bench`` and ``eval/bench_engine.py``.

One process, one model, one prompt: full prefill (ordinary KV cache) vs Prompt Cache, four ways
(the first prompt of a fresh engine; fresh buffer; reused buffer, every module copied; modules
already in place) vs the true limit: the forward of the new tokens alone on an already assembled,
preallocated cache, computing logits for the last token only (no concatenation, no copy).
Medians after a warm-up, every method timed once per round (round-robin: a shared machine's
load drifts over seconds, and ratios of methods timed side by side hold where block timings do
not). Encoding is timed against one plain prefill of the same tokens.

The first prompt of a fresh engine (a new ``PromptCache`` on the same loaded model, which
encodes the schema and then serves the prompt once) finds its modules already in place: the
engine places the schema's default pass into a prewarmed buffer at registration (on CPU), so
that prompt pays the forward and the planning, not a copy of every module. A fresh *process*
is measured by ``fresh_first_prompt`` (``eval/bench_engine.py --fresh-processes N``): the first
prompt of a process that has loaded the model and encoded the schema, against the limit timed
right after it in the same process.
"""

from __future__ import annotations

import logging
import os
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
    load_avg: float = 0.0  # the 1-minute load average when the timings ended (0 where unknown)

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
                f"{100 * (self.bytes_per_token / self.theory_bytes_per_token - 1):+.2f}%)",
                f"load average at the end of the timings: {self.load_avg:.2f}"]
        return out


def first_prompt(pc, schema: str, prompt: str) -> float:
    """TTFT of the first prompt of a fresh engine on ``pc``'s model (it encodes the schema first)."""
    fresh = type(pc)(pc.model, pc.tokenizer, pc.config)
    fresh.add_schema(schema)
    ttft = fresh.prefill(prompt).ttft
    fresh.clear_buffers()
    return ttft


class _Limit:
    """The true limit for one prompt: the forward of its new tokens on a kept, assembled cache
    (length reset to the cached part before each call), last-token logits only."""

    def __init__(self, pc, prompt: str):
        self.pc, self.kept = pc, pc.prefill(prompt, keep_cache=True)
        new = self.kept.layout.new
        self.ids = torch.tensor([[t for s in new for t in s.token_ids]], device=pc.device)
        self.pos = torch.tensor([[p for s in new for p in s.position_ids]], device=pc.device)

    def __call__(self) -> None:
        self.kept.cache.set_length(self.kept.cached_tokens)
        self.pc.adapter.forward(self.ids, self.pos, self.kept.cache)
        if self.pc.device.type == "cuda":
            torch.cuda.synchronize(self.pc.device)

    def close(self) -> None:
        self.pc.release(self.kept)


def fresh_first_prompt(pc, schema_tokens: int, new_tokens: int = 32, limits: int = 5) -> dict:
    """For a brand-new engine (call it first thing in a fresh process): encode the bench schema,
    time the engine's very first prompt, then the limit ``limits`` times and the same prompt again
    (modules in place), alternating. Seconds; ``limit_s`` and ``inplace_s`` are medians."""
    entry = pc.add_schema(build_schema(pc.tokenizer, schema_tokens))
    prompt = build_prompt(pc, 8, new_tokens)
    res = pc.prefill(prompt)
    limit, lim, again = _Limit(pc, prompt), [], []
    for _ in range(limits):
        lim.append(_timed(limit))
        again.append(pc.prefill(prompt).ttft)
    limit.close()
    return dict(cached_tokens=entry.stored_tokens, first_s=res.ttft, first_bytes_copied=res.bytes_copied,
                limit_s=statistics.median(lim), inplace_s=statistics.median(again))


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def round_robin(methods: dict[str, Callable[[], object]], rounds: int, only: dict[str, int] | None = None,
                say: Callable[[str], None] = lambda step: None) -> dict[str, float]:
    """Median seconds per method, timed one call of each per round (so slow drifts of a shared
    machine's load hit every method alike). ``only[name] = k``: that method in the first k rounds."""
    times: dict[str, list[float]] = {name: [] for name in methods}
    for r in range(rounds):
        say(f"round {r + 1}/{rounds}")
        for name, fn in methods.items():
            if r < (only or {}).get(name, rounds):
                times[name].append(_timed(fn))
    return {name: statistics.median(ts) for name, ts in times.items()}


def run(pc, schema_tokens: int = 2000, new_tokens: int = 32, repeats: int = 10,
        announce: Callable[[str], None] | None = None, fresh_engines: int = 1) -> BenchResult:
    """Benchmark a PromptCache (its model and tokenizer) on a synthetic schema. ``announce(step)``
    is called as each step starts (default: an INFO log line), so long runs are never silent.

    After a warm-up, every method is timed once per round, round-robin, ``repeats`` rounds
    (full prefill in the first ``max(3, repeats // 3)``, the first prompt of a fresh engine in
    the first ``fresh_engines``: each of those encodes the schema again, untimed); medians."""
    say = announce or (lambda step: log.info("bench: %s", step))
    say(f"encoding a {schema_tokens}-token schema")
    schema = build_schema(pc.tokenizer, schema_tokens)
    t0 = time.perf_counter()
    entry = pc.add_schema(schema)
    encode_s = time.perf_counter() - t0
    schema_ids = [t for i in entry.default_order() for t in entry.layout.spans[i].token_ids]
    encode_plain_s = median_time(lambda: pc.runner.prefill_plain(schema_ids), repeats=1, warmup=0)
    prompt = build_prompt(pc, 8, new_tokens)
    first = pc.prefill(prompt)
    limit = _Limit(pc, prompt)  # its buffer is held outside the pool for the whole run

    def cold():
        pc.clear_buffers()
        return pc.prefill(prompt)

    def copy_all():
        pc.forget_placement()
        return pc.prefill(prompt)

    firsts: list[float] = []
    methods = {"first": lambda: firsts.append(first_prompt(pc, schema, prompt)),
               "full": lambda: pc.prefill_baseline(prompt), "cold": cold, "copy": copy_all,
               "inplace": lambda: pc.prefill(prompt), "limit": limit}
    say("warm-up")
    for name in ("full", "cold", "copy", "inplace", "limit"):
        methods[name]()
    say(f"timing {repeats} rounds, round-robin (full prefill in {max(3, repeats // 3)}, "
        f"a fresh engine's first prompt in {fresh_engines})")
    t = round_robin(methods, repeats, {"full": max(3, repeats // 3), "first": fresh_engines}, say)
    copied = copy_all().bytes_copied
    limit.close()
    t_layout = median_time(lambda: pc.layout(prompt), repeats)
    stored = [pc.store.get(k)[0] for k in entry.keys.values()]
    measured = sum(x.numel() * x.element_size() for x in stored) / entry.stored_tokens  # what the store holds
    return BenchResult(first.cached_tokens, first.new_tokens, encode_s, t["full"], statistics.median(firsts),
                       t["cold"], t["copy"], t["inplace"], t["limit"], t_layout, copied, measured,
                       entry.bytes_per_token, encode_plain_s, str(pc.runner.stored_spec.dtype).removeprefix("torch."),
                       load_avg())


def load_avg() -> float:
    """The 1-minute load average (0.0 where the OS has none)."""
    return round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else 0.0
