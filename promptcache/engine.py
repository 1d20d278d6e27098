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

import functools
import json
import logging
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from . import compiled
from .cache import CachePool, SpliceCache
from .encoder import Progress, SchemaEncoder
from .generation import Generation, GenerationStream
from .layout import PromptLayout, SchemaLayout, Span, layout_prompt, layout_schema
from .models import get_adapter
from .pml import PMLError, parse_prompt
from .pml.nodes import Prompt
from .sampling import eos_ids
from .store import StoreConfig, build_store
from .keys import content_keys, model_fingerprint, tokenizer_fingerprint
from .tokens import as_span_tokenizer

__all__ = ["EncodedSchema", "EngineConfig", "Generation", "GenerationStream", "PrefillResult", "PromptCache"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class EngineConfig:
    """Engine settings. Budgets are bytes of stored module states per tier (None: unbounded);
    on a CPU-only engine device memory is host memory and ``host_budget`` applies."""

    device: str | None = None  # default: the model's device
    encode_chunk: int = 2048  # tokens per forward while encoding the default pass
    encode_batch_bytes: int = 256 << 20  # KV bytes a batched encoding forward may allocate
    device_budget: int | None = None
    host_budget: int | None = None
    spill_dir: str | None = None  # evicted states with no artifact go here (default: a temp dir)
    pin_memory: bool = True
    namespace: str = "default"  # cache namespace (salt): states are never shared across namespaces

    def __post_init__(self):
        if self.encode_chunk < 1 or self.encode_batch_bytes < 0:
            raise ValueError(f"bad EngineConfig: {self}")

    def store_config(self) -> StoreConfig:
        return StoreConfig(self.device_budget, self.host_budget, self.spill_dir, self.pin_memory)


@dataclass
class EncodedSchema:
    """A schema whose modules are encoded; ``keys[i]`` is stored span i's content key."""

    layout: SchemaLayout
    keys: dict[int, str]
    positions: dict[int, torch.Tensor]
    contexts: dict[int, tuple[int, ...]]  # span -> the spans before it in its encoding pass
    namespace: str
    bytes_per_token: int
    encode_seconds: float = 0.0

    @property
    def name(self) -> str:
        return self.layout.name

    @property
    def stored_tokens(self) -> int:
        return sum(len(self.layout.spans[i].token_ids) for i in self.keys)

    @property
    def stored_bytes(self) -> int:
        return self.stored_tokens * self.bytes_per_token


@dataclass
class PrefillResult:
    logits: torch.Tensor  # [vocab], next-token logits after the prompt
    ttft: float  # seconds: prompt in, logits out
    cached_tokens: int
    new_tokens: int
    exact: bool  # the state equals a plain prefill of the same tokens
    bytes_copied: int = 0  # stored KV bytes copied to assemble this prompt (0: all already in place)
    hit_tiers: dict[str, int] = field(default_factory=dict)  # cached spans served per tier
    layout: PromptLayout | None = None
    cache: object = field(default=None, repr=False)  # kept only with prefill(keep_cache=True)
    next_position: int = 0


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
        self.store = build_store(self.device, self.config.store_config())
        self._lock = threading.RLock()  # one forward at a time per engine
        self._schemas: dict[tuple[str, str], EncodedSchema] = {}
        self._pool = CachePool(self.spec, self.device)
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

    @functools.cached_property
    def model_fingerprint(self) -> dict[str, str]:
        return model_fingerprint(self.model)

    @functools.cached_property
    def tokenizer_fingerprint(self) -> str:
        return tokenizer_fingerprint(self.tokenizer)

    @functools.cached_property
    def model_key(self) -> str:
        """Model and tokenizer fingerprints in one string: the part of every content key that names the model."""
        return json.dumps(self.model_fingerprint, sort_keys=True) + self.tokenizer_fingerprint

    # -- schemas ---------------------------------------------------------------------------------
    def add_schema(self, schema: str | Path, progress: Progress | None = None,
                   namespace: str | None = None) -> EncodedSchema:
        """Parse, lay out and encode a schema (only modules not stored yet are encoded).
        On any error the engine is left unchanged."""
        t0 = time.perf_counter()
        layout = layout_schema(schema, self.tok)
        ns = namespace or self.config.namespace
        keys = content_keys(layout, self.model_key, ns)
        missing = [i for i, k in keys.items() if k not in self.store]
        states = self._encoder.encode(layout, progress) if missing else {}
        for i in missing:
            self.store.put(keys[i], states[i])
        return self._register(layout, keys, ns, time.perf_counter() - t0)

    def _register(self, layout: SchemaLayout, keys: dict[int, str], ns: str, seconds: float) -> EncodedSchema:
        positions = {i: torch.arange(layout.spans[i].start, layout.spans[i].end, device=self.device) for i in keys}
        contexts = {t: p.spans[: p.spans.index(t)] for p in layout.passes() for t in p.targets}
        entry = EncodedSchema(layout, keys, positions, contexts, ns, self.spec.bytes_per_token, seconds)
        with self._lock:
            self._schemas[(ns, layout.name)] = entry
        if self.device.type == "cpu":  # fresh CPU memory faults page by page on first touch
            self._pool.prewarm(layout.end + 64)
        log.info("schema '%s' (namespace '%s'): %d tokens stored (%.1f MiB) in %.2fs", entry.name, ns,
                 entry.stored_tokens, entry.stored_bytes / 2**20, seconds)
        return entry

    register_schema = _register  # merge: the engine package provides register_schema

    def compile(self, schema: str | Path, out_dir: str | Path, progress: Progress | None = None,
                namespace: str | None = None, source_name: str | None = None) -> Path:
        """Encode a schema and write it as a compiled artifact (safetensors + manifest.json)."""
        return compiled.compile_schema(self, schema, out_dir, progress, namespace, source_name)

    def load_compiled(self, path: str | Path, schema: str | Path | None = None, recompile: bool = False,
                      namespace: str | None = None, verify: bool = False) -> EncodedSchema:
        """Register a compiled schema; its states stay on disk (memory-mapped, checksummed) until
        used. ``schema``: the schema source, to check the artifact was compiled from it.
        A mismatch (model, tokenizer, schema text) is refused unless ``recompile``; ``verify``
        reads and checks every state now instead of on first use."""
        return compiled.load_compiled(self, path, schema, recompile, namespace, verify)

    def encode_span(self, token_ids: list[int], start: int = 0) -> torch.Tensor:
        """States of tokens encoded alone (no context) at positions start..: [L, 2, H, n, D]."""
        return self._encoder.encode_alone(token_ids, start)

    def schema(self, name: str, namespace: str | None = None) -> EncodedSchema:
        ns = namespace or self.config.namespace
        entry = self._schemas.get((ns, name))
        if entry is None:
            known = ", ".join(sorted(n for s, n in self._schemas if s == ns)) or "none"
            raise PMLError(f"unknown schema '{name}' (added in namespace '{ns}': {known})")
        return entry

    @property
    def schemas(self) -> list[str]:
        return sorted(n for s, n in self._schemas if s == self.config.namespace)

    # -- prompts ---------------------------------------------------------------------------------
    def layout(self, prompt: str | Path | Prompt, namespace: str | None = None) -> PromptLayout:
        """The prompt's ordered spans (``.kind``, ``.name``, ``.token_ids``, ``.position_ids``)."""
        tree = prompt if isinstance(prompt, Prompt) else parse_prompt(prompt)
        schema = self.schema(tree.schema, namespace).layout if tree.schema is not None else None
        return layout_prompt(tree, schema, self.tok)

    def prefill(self, prompt: str | Path | Prompt, reserve: int = 0, keep_cache: bool = False,
                namespace: str | None = None) -> PrefillResult:
        """Assemble the prompt's cache and run its new tokens: next-token logits and statistics.

        ``keep_cache=True`` hands the assembled cache to the caller (``result.cache``, with room
        for ``reserve`` more tokens); call ``release(result)`` when done so it can be reused."""
        t0 = time.perf_counter()
        layout = self.layout(prompt, namespace)
        entry = self.schema(layout.schema.name, namespace) if layout.schema is not None else None
        hits: Counter[str] = Counter()
        cached = []  # (content key, kv [L, 2, H, n, D], positions [n], span index)
        cached_spans, new_spans = layout.cached, layout.new  # each is a filter over the spans: once
        for s in cached_spans:
            key = entry.keys[s.schema_index]
            kv, tier = self.store.get(key)
            hits[tier] += 1
            cached.append((key, kv, entry.positions[s.schema_index], s.schema_index))
        new_ids = [t for s in new_spans for t in s.token_ids]
        new_pos = [p for s in new_spans for p in s.position_ids]
        if not new_ids:  # recompute the last cached token so there are logits to return
            last = cached_spans[-1]
            new_ids, new_pos = [last.token_ids[-1]], [last.position_ids[-1]]
            key, kv, pos, idx = cached[-1]
            cached[-1] = (key + "[:-1]", kv[:, :, :, :-1], pos[:-1], idx)
        res = self.run_spliced([(k, kv, pos) for k, kv, pos, _ in cached], new_ids, new_pos,
                               max(layout.position_ids), t0, reserve, keep_cache)
        res.exact = _is_exact(cached_spans, new_spans, entry, cached)
        res.hit_tiers, res.layout = dict(hits), layout
        return res

    def run_spliced(self, cached: list[tuple[str, torch.Tensor, torch.Tensor]], new_ids: list[int],
                    new_pos: list[int], max_position: int, t0: float | None = None, reserve: int = 0,
                    keep_cache: bool = False) -> PrefillResult:
        """The splice itself: stored states (content key, kv [L, 2, H, n, D], positions [n]) placed
        in order, then ``new_ids`` run at ``new_pos`` on top; ``max_position`` is the largest
        position of the prompt (generation continues after it). Used by ``prefill`` and the RAG store."""
        t0 = time.perf_counter() if t0 is None else t0
        n_cached = sum(len(pos) for _, _, pos in cached)
        self.adapter.check_limits(max_position, n_cached + len(new_ids) + reserve)
        cache = self._pool.acquire(n_cached + len(new_ids) + reserve, [(k, len(pos)) for k, _, pos in cached])
        try:
            copied = cache.place(cached)
            ids = torch.tensor([new_ids], dtype=torch.long, device=self.device)
            pos_t = torch.tensor([new_pos], dtype=torch.long, device=self.device)
            with self._lock:
                logits = self.adapter.forward(ids, pos_t, cache)[0]
            _sync(self.device)
        except BaseException:
            self._pool.release(cache)
            raise
        ttft = time.perf_counter() - t0
        if not keep_cache:
            self._pool.release(cache)
            cache = None
        return PrefillResult(logits, ttft, n_cached, len(new_ids), False, copied, {}, None, cache, max_position + 1)

    def release(self, result: PrefillResult) -> None:
        """Return a kept cache (``prefill(keep_cache=True)``) for reuse by later prompts."""
        if isinstance(result.cache, SpliceCache):
            self._pool.release(result.cache)
        result.cache = None

    def generate(self, prompt, max_new_tokens: int = 64, temperature: float = 0.0, top_p: float = 1.0,
                 top_k: int = 0, stop: list[str] | None = None, seed: int | None = None,
                 use_cache: bool = True, namespace: str | None = None) -> Generation:
        """Generate text after the prompt. ``use_cache=False`` is the baseline: the same tokens in
        prompt order at contiguous positions, one plain prefill with the ordinary KV cache."""
        start = functools.partial(self._start, prompt, use_cache=use_cache, namespace=namespace)
        return self.generate_from(start, max_new_tokens, temperature, top_p, top_k, stop, seed)

    def stream(self, prompt, max_new_tokens: int = 64, temperature: float = 0.0, top_p: float = 1.0,
               top_k: int = 0, stop: list[str] | None = None, seed: int | None = None,
               use_cache: bool = True, namespace: str | None = None) -> GenerationStream:
        """Text pieces as they are decoded (same arguments as ``generate``); after the loop,
        ``.result`` holds the Generation with its statistics."""
        start = functools.partial(self._start, prompt, use_cache=use_cache, namespace=namespace)
        return self.stream_from(start, max_new_tokens, temperature, top_p, top_k, stop, seed)

    def generate_from(self, start: Callable[[int], PrefillResult], max_new_tokens: int = 64,
                      temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0,
                      stop: list[str] | None = None, seed: int | None = None) -> Generation:
        """Generate from a prefill: ``start(reserve)`` returns a PrefillResult holding its cache
        (room for ``reserve`` more tokens). ``generate`` and the RAG store use this."""
        return GenerationStream(self, start, max_new_tokens, temperature, top_p, top_k, stop, seed).run()

    def stream_from(self, start: Callable[[int], PrefillResult], max_new_tokens: int = 64,
                    temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0,
                    stop: list[str] | None = None, seed: int | None = None) -> GenerationStream:
        return GenerationStream(self, start, max_new_tokens, temperature, top_p, top_k, stop, seed)

    def _start(self, prompt, reserve: int, use_cache: bool, namespace: str | None = None) -> PrefillResult:
        if use_cache:
            return self.prefill(prompt, reserve, keep_cache=True, namespace=namespace)
        return self.prefill_baseline(prompt, namespace)

    def prefill_baseline(self, prompt, namespace: str | None = None) -> PrefillResult:
        """Full prefill of the prompt's tokens (prompt order, positions 0..n-1), stock model path."""
        t0 = time.perf_counter()
        layout = self.layout(prompt, namespace)
        ids = torch.tensor([layout.token_ids], dtype=torch.long, device=self.device)
        with self._lock, torch.inference_mode():
            out = self.model(input_ids=ids, use_cache=True, logits_to_keep=1)
        logits = out.logits[0, -1]
        _sync(self.device)
        n = ids.shape[1]
        return PrefillResult(logits, time.perf_counter() - t0, 0, n, True, layout=layout,
                             cache=out.past_key_values, next_position=n)


def _is_exact(cached_spans: list[Span], new_spans: list[Span], entry: EncodedSchema | None, cached) -> bool:
    """True when the assembled state equals a plain prefill of the same tokens: positions run
    0..n-1 in cache order and every cached span was encoded after exactly the spans before it."""
    positions = [p for s in cached_spans + new_spans for p in s.position_ids]
    if positions != list(range(len(positions))):
        return False
    seen: list[int] = []
    for *_, idx in cached:
        if entry.contexts.get(idx) != tuple(seen):
            return False
        seen.append(idx)
    return True


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
