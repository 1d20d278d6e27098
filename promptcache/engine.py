"""The engine: encode schemas once, serve prompts from spliced attention states.

    pc = PromptCache(model, tokenizer)
    pc.add_schema("schemas/travel.xml")
    out = pc.generate("examples/travel_tokyo.xml", max_new_tokens=64)

Prompt time (the hot path): layout -> copy the imported spans' stored states into one
preallocated cache (KV order: cached spans in prompt order, then new tokens) -> one forward of
the new tokens at their position IDs -> logits. New tokens attend to every cached entry and to
the new tokens before them, which is the paper's definition (DESIGN.md section 4).

Decisions:
  * A prompt with no new tokens recomputes its last cached token as a new token (its stored entry
    is left out), so next-token logits reflect exactly what the prompt imports.
  * Generated tokens take positions after the largest position in the prompt.
  * Model forwards are serialized by a lock per PromptCache; ALiBi position context is
    thread-local. Several threads may call ``generate`` on one PromptCache.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import torch

import itertools

from .cache import CachePool, SpliceCache
from .encoder import Progress, SchemaEncoder
from .layout import PromptLayout, SchemaLayout, layout_prompt, layout_schema
from .models import get_adapter
from .pml import PMLError, parse_prompt
from .pml.nodes import Prompt
from .sampling import TextStream, decode_loop, eos_ids, make_sampler
from .tokens import as_span_tokenizer

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class EngineConfig:
    device: str | None = None  # default: the model's device
    encode_chunk: int = 2048  # tokens per forward while encoding the default pass
    encode_batch_bytes: int = 256 << 20  # KV bytes a batched encoding forward may allocate

    def __post_init__(self):
        if self.encode_chunk < 1 or self.encode_batch_bytes < 0:
            raise ValueError(f"bad EngineConfig: {self}")


@dataclass
class EncodedSchema:
    """A schema whose modules are encoded. ``kv[i]``: states of stored span i, [L, 2, H, n, D]."""

    layout: SchemaLayout
    kv: dict[int, torch.Tensor]
    positions: dict[int, torch.Tensor]
    contexts: dict[int, tuple[int, ...]]  # span -> the spans before it in its encoding pass
    encode_seconds: float = 0.0
    serial: int = field(default_factory=itertools.count().__next__)  # tells re-added schemas apart

    @property
    def name(self) -> str:
        return self.layout.name

    @property
    def stored_tokens(self) -> int:
        return sum(t.shape[3] for t in self.kv.values())

    @property
    def stored_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.kv.values())


@dataclass
class PrefillResult:
    logits: torch.Tensor  # [vocab], next-token logits after the prompt
    ttft: float  # seconds: prompt in, logits out
    cached_tokens: int
    new_tokens: int
    exact: bool  # the state equals a plain prefill of the same tokens
    bytes_copied: int = 0  # stored KV bytes copied to assemble this prompt (0: all already in place)
    layout: PromptLayout | None = None
    cache: object = field(default=None, repr=False)  # kept only with prefill(keep_cache=True)
    next_position: int = 0


@dataclass
class Generation:
    text: str
    token_ids: list[int]
    ttft: float
    cached_tokens: int
    new_tokens: int
    exact: bool = False


class PromptCache:
    """Prompt Cache over a loaded ``transformers`` causal LM and its tokenizer."""

    def __init__(self, model, tokenizer, config: EngineConfig | None = None):
        self.config = config or EngineConfig()
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.tok = as_span_tokenizer(tokenizer)
        self.adapter = get_adapter(model)
        self.spec = self.adapter.kv_spec()
        self.device = torch.device(self.config.device) if self.config.device else next(model.parameters()).device
        self._lock = threading.RLock()  # one forward at a time per engine
        self._schemas: dict[str, EncodedSchema] = {}
        self._pool = CachePool(self.spec, self.device, pin=False)
        self._encoder = SchemaEncoder(self.adapter, self.spec, self.device, self._lock,
                                      self.config.encode_chunk, self.config.encode_batch_bytes, self.tok.pad_id)
        self._eos = eos_ids(model, tokenizer)

    @classmethod
    def from_pretrained(cls, name_or_path: str | Path, device: str = "cpu", dtype: str = "float32",
                        config: EngineConfig | None = None, **load_kwargs) -> "PromptCache":
        """Load a Hugging Face model id or a local directory (see ``models.loading``)."""
        from .models.loading import load_model

        model, tokenizer = load_model(name_or_path, device=device, dtype=dtype, **load_kwargs)
        return cls(model, tokenizer, config)

    # -- schemas ---------------------------------------------------------------------------------
    def add_schema(self, schema: str | Path, progress: Progress | None = None) -> EncodedSchema:
        """Parse, lay out and encode a schema; on any error the engine is left unchanged."""
        t0 = time.perf_counter()
        layout = layout_schema(schema, self.tok)
        kv = self._encoder.encode(layout, progress)
        positions = {i: torch.arange(layout.spans[i].start, layout.spans[i].end, device=self.device) for i in kv}
        contexts = {t: p.spans[: p.spans.index(t)] for p in layout.passes() for t in p.targets}
        entry = EncodedSchema(layout, kv, positions, contexts, time.perf_counter() - t0)
        self._schemas[layout.name] = entry
        log.info("schema '%s': %d tokens stored (%.1f MiB) in %.2fs", entry.name, entry.stored_tokens,
                 entry.stored_bytes / 2**20, entry.encode_seconds)
        return entry

    def schema(self, name: str) -> EncodedSchema:
        if name not in self._schemas:
            known = ", ".join(sorted(self._schemas)) or "none"
            raise PMLError(f"unknown schema '{name}' (added: {known})")
        return self._schemas[name]

    @property
    def schemas(self) -> list[str]:
        return sorted(self._schemas)

    # -- prompts ---------------------------------------------------------------------------------
    def layout(self, prompt: str | Path | Prompt) -> PromptLayout:
        """The prompt's ordered spans (``.kind``, ``.name``, ``.token_ids``, ``.position_ids``)."""
        tree = prompt if isinstance(prompt, Prompt) else parse_prompt(prompt)
        schema = self.schema(tree.schema).layout if tree.schema is not None else None
        return layout_prompt(tree, schema, self.tok)

    def prefill(self, prompt: str | Path | Prompt, reserve: int = 0, keep_cache: bool = False) -> PrefillResult:
        """Assemble the prompt's cache and run its new tokens: next-token logits and statistics.

        ``keep_cache=True`` hands the assembled cache to the caller (``result.cache``, with room
        for ``reserve`` more tokens); call ``release(result)`` when done so it can be reused."""
        t0 = time.perf_counter()
        layout = self.layout(prompt)
        entry = self._schemas[layout.schema.name] if layout.schema is not None else None
        cached = [(entry.kv[s.schema_index], entry.positions[s.schema_index], s.schema_index) for s in layout.cached]
        serial = entry.serial if entry is not None else -1
        new_ids = [t for s in layout.new for t in s.token_ids]
        new_pos = [p for s in layout.new for p in s.position_ids]
        if not new_ids:  # recompute the last cached token so there are logits to return
            last = layout.cached[-1]
            new_ids, new_pos = [last.token_ids[-1]], [last.position_ids[-1]]
            kv, pos, idx = cached[-1]
            cached[-1] = (kv[:, :, :, :-1], pos[:-1], idx)
        n_cached = sum(kv.shape[3] for kv, _, _ in cached)
        self.adapter.check_limits(max(layout.position_ids), n_cached + len(new_ids) + reserve)
        place = [((serial, idx), kv, pos) for kv, pos, idx in cached]
        cache = self._pool.acquire(n_cached + len(new_ids) + reserve, [(k, kv.shape[3]) for k, kv, _ in place])
        copied = cache.place(place)
        ids = torch.tensor([new_ids], dtype=torch.long, device=self.device)
        pos_t = torch.tensor([new_pos], dtype=torch.long, device=self.device)
        try:
            with self._lock:
                logits = self.adapter.forward(ids, pos_t, cache)[0]
            _sync(self.device)
        except BaseException:
            self._pool.release(cache)
            raise
        ttft = time.perf_counter() - t0
        exact = _is_exact(layout, entry, cached)
        if not keep_cache:
            self._pool.release(cache)
            cache = None
        return PrefillResult(logits, ttft, n_cached, len(new_ids), exact, copied, layout, cache,
                             max(layout.position_ids) + 1)

    def release(self, result: PrefillResult) -> None:
        """Return a kept cache (``prefill(keep_cache=True)``) for reuse by later prompts."""
        if isinstance(result.cache, SpliceCache):
            self._pool.release(result.cache)
        result.cache = None

    def generate(self, prompt, max_new_tokens: int = 64, temperature: float = 0.0, top_p: float = 1.0,
                 top_k: int = 0, stop: list[str] | None = None, seed: int | None = None,
                 use_cache: bool = True) -> Generation:
        """Generate text after the prompt. ``use_cache=False`` is the baseline: the same tokens in
        prompt order at contiguous positions, one plain prefill with the ordinary KV cache."""
        stream = TextStream(self.tokenizer, stop)
        ids: list[int] = []
        state = None
        for tok, state in self._tokens(prompt, max_new_tokens, temperature, top_p, top_k, seed, use_cache):
            ids.append(tok)
            stream.push(tok)
            if stream.stopped:
                break
        if state is None:
            state = self.prefill(prompt) if use_cache else self.prefill_baseline(prompt)
        return Generation(stream.text, ids, state.ttft, state.cached_tokens, state.new_tokens, state.exact)

    def stream(self, prompt, max_new_tokens: int = 64, temperature: float = 0.0, top_p: float = 1.0,
               top_k: int = 0, stop: list[str] | None = None, seed: int | None = None,
               use_cache: bool = True) -> Iterator[str]:
        """Yield text pieces as they are decoded (same arguments as ``generate``)."""
        stream = TextStream(self.tokenizer, stop)
        for tok, _ in self._tokens(prompt, max_new_tokens, temperature, top_p, top_k, seed, use_cache):
            piece = stream.push(tok)
            if piece:
                yield piece
            if stream.stopped:
                return
        tail = stream.flush()
        if tail:
            yield tail

    # -- internals -------------------------------------------------------------------------------
    def _tokens(self, prompt, max_new_tokens, temperature, top_p, top_k, seed, use_cache):
        if max_new_tokens < 1:
            return
        sampler = make_sampler(temperature, top_p, top_k, seed)
        state = self._start(prompt, max_new_tokens, use_cache)
        try:
            step = self._stepper(state, use_cache)
            for tok in decode_loop(state.logits, step, sampler, max_new_tokens, self._eos):
                yield tok, state
        finally:
            self.release(state)

    def _start(self, prompt, reserve: int, use_cache: bool) -> PrefillResult:
        return self.prefill(prompt, reserve, keep_cache=True) if use_cache else self.prefill_baseline(prompt)

    def _stepper(self, state: PrefillResult, use_cache: bool):
        pos = state.next_position

        def step(tok: int) -> torch.Tensor:
            nonlocal pos
            ids = torch.tensor([[tok]], dtype=torch.long, device=self.device)
            with self._lock:
                if use_cache:
                    p = torch.tensor([[pos]], dtype=torch.long, device=self.device)
                    pos += 1
                    return self.adapter.forward(ids, p, state.cache)[0]
                with torch.inference_mode():
                    out = self.model(input_ids=ids, past_key_values=state.cache, use_cache=True, logits_to_keep=1)
                return out.logits[0, -1]

        return step

    def prefill_baseline(self, prompt) -> PrefillResult:
        """Full prefill of the prompt's tokens (prompt order, positions 0..n-1), stock model path."""
        t0 = time.perf_counter()
        layout = self.layout(prompt)
        ids = torch.tensor([layout.token_ids], dtype=torch.long, device=self.device)
        with self._lock, torch.inference_mode():
            out = self.model(input_ids=ids, use_cache=True, logits_to_keep=1)
        logits = out.logits[0, -1]
        _sync(self.device)
        n = ids.shape[1]
        return PrefillResult(logits, time.perf_counter() - t0, 0, n, True, layout=layout,
                             cache=out.past_key_values, next_position=n)


def _is_exact(layout: PromptLayout, entry: EncodedSchema | None, cached) -> bool:
    """True when the assembled state equals a plain prefill of the same tokens: positions run
    0..n-1 in cache order and every cached span was encoded after exactly the spans before it."""
    positions = [p for s in layout.cached for p in s.position_ids] + [p for s in layout.new for p in s.position_ids]
    if positions != list(range(len(positions))):
        return False
    seen: list[int] = []
    for _, _, idx in cached:
        if entry.contexts.get(idx) != tuple(seen):
            return False
        seen.append(idx)
    return True


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
