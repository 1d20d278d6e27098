"""``EngineCore``: the engine in one object, built from a model, its tokenizer and an ``EngineConfig``.

    core = EngineCore(model, tokenizer, config)
    core.add_schema(Path("schemas/travel.xml"))
    reqs = [Request(core.prompt_spec(p), params, tokenizer) for p in prompts]
    core.engine().run(reqs)

It owns every service a request touches: the runner (model, forwards, private buffers), the
tiered store, the registry of encoded schemas, the schema encoder, the one planner
(``planner.Planner``: the only place a ``PrefillPlan`` comes from) and, built on first use, the
serving engine (``serving_core/core.Engine``: the KV pool, the prefix chains and the scheduler).
``PromptCache`` (``facade.py``) is a thin user-facing shell over it; nothing below this module
holds the ``PromptCache``: the serving engine gets this core, the scheduler the planner, a
prompt spec nothing but data.
"""

from __future__ import annotations

import functools
import threading
import time
from pathlib import Path

import torch

from ..kernels import fuse_mlps_and_rotary, fuse_rms_norms
from ..layout import PromptLayout, layout_schema
from ..models.packed import pack_linears
from ..pml import parse_prompt
from ..pml.nodes import Prompt
from ..progress import progress_for
from ..store import build_store
from ..tokens import as_span_tokenizer
from ..tunables import PREWARM_SLACK
from .planner import Planner
from .prefill.config import EngineConfig, ServingConfig
from .prefill.plan import PrefillPlan, Segment
from .prefill.results import PrefillResult
from .prefill.runner import ModelRunner
from .schemas import compiled
from .schemas.encoder import Progress, SchemaEncoder
from .schemas.registry import EncodedSchema, SchemaRegistry
from .serving_core.core import Engine
from .serving_core.prompts import PmlPrompt, PromptSpec, TokenPrompt

__all__ = ["EngineCore"]


class EngineCore:
    """Runner, store, registry, encoder, planner and serving engine of one loaded model."""

    def __init__(self, model, tokenizer, config: EngineConfig | None = None):
        self.config = config or EngineConfig()
        self.tokenizer = tokenizer
        self.tok = as_span_tokenizer(tokenizer)
        device = torch.device(self.config.runner.device) if self.config.runner.device else None
        if self.config.runner.packed_linear:  # the CPU fast path: packed linears, one-pass norms, MLPs, rotary
            pack_linears(model)
            fuse_rms_norms(model)
            fuse_mlps_and_rotary(model)
        self.runner = ModelRunner(model, tokenizer, device, self.config.runner.kv_dtype, self.config.runner.overlap_copies)
        self.model, self.adapter, self.spec, self.device = model, self.runner.adapter, self.runner.spec, self.runner.device
        self.store = build_store(self.device, self.config.store, self.adapter.sliding_windows())
        self.registry = SchemaRegistry(model, tokenizer, self.runner.stored_spec.bytes_per_token, self.device)
        self.encoder = SchemaEncoder(self.runner, self.config.runner.encode_chunk, self.config.runner.encode_batch_bytes,
                                     self.tok.pad_id)
        self.planner = Planner(self.config, self.runner, self.store, self.registry, self.encoder, self.tok)
        self._engine: Engine | None = None
        self._engine_lock = threading.Lock()

    @property
    def model_fingerprint(self) -> dict[str, str]:
        return self.registry.model_fingerprint

    @property
    def tokenizer_fingerprint(self) -> str:
        return self.registry.tokenizer_fingerprint

    @property
    def model_key(self) -> str:
        """Model and tokenizer fingerprints in one string: the part of every content key that names the model."""
        return self.registry.model_key

    # -- schemas ---------------------------------------------------------------------------------
    def add_schema(self, schema: str | Path, progress: Progress | None = None,
                   namespace: str | None = None, *, allow_src_root: str | Path | None = None) -> EncodedSchema:
        """``PromptCache.add_schema``."""
        t0 = time.perf_counter()
        layout = layout_schema(schema, self.tok, max_positions=self.adapter.max_positions,
                               allow_src_root=allow_src_root)
        ns = self.config.namespace_for(namespace)
        keys = self.registry.content_keys(layout, ns)
        encoded = self.planner.ensure_states(layout, keys, progress or progress_for(f"encoding {layout.name}"))
        # placed now only when every state was just encoded and still sits in memory: states held
        # by another tier (disk, a remote store) are fetched by the first prompt that needs them,
        # and reading them here would promote them and churn tight memory budgets
        seconds = time.perf_counter() - t0
        in_memory = all(self.store.tier_of(k) in ("device", "host") for k in keys.values())
        return self.register_schema(layout, keys, ns, seconds,
                                    place=in_memory and len(encoded) == len(set(keys.values())))

    def register_schema(self, layout, keys: dict[int, str], namespace: str, seconds: float,
                        place: bool = True) -> EncodedSchema:
        """``PromptCache.register_schema``."""
        entry = self.registry.register(layout, keys, namespace, seconds)
        stored = [Segment(keys[i], None, entry.positions[i], load=functools.partial(self._stored_states, keys[i]))
                  for i in entry.default_order()] if place else []
        self.runner.prewarm(layout.end + PREWARM_SLACK, stored)
        return entry

    def _stored_states(self, key: str) -> torch.Tensor:
        return self.store.get(key)[0]

    def compile(self, schema: str | Path, out_dir: str | Path, progress: Progress | None = None,
                namespace: str | None = None, source_name: str | None = None) -> Path:
        return compiled.compile_schema(self, schema, out_dir, progress, namespace, source_name)

    def load_compiled(self, path: str | Path, schema: str | Path | None = None, recompile: bool = False,
                      namespace: str | None = None, verify: bool = False, convert: bool = False) -> EncodedSchema:
        return compiled.load_compiled(self, path, schema, recompile, namespace, verify, convert)

    # -- prompts ---------------------------------------------------------------------------------
    def prefill(self, prompt: str | Path | Prompt, reserve: int = 0, keep_cache: bool = False,
                namespace: str | None = None, *, recompute: float | str | None = None,
                layout: PromptLayout | None = None) -> PrefillResult:
        """``PromptCache.prefill``: the plan assembled in a private buffer, the logits alone."""
        t0 = time.perf_counter()
        r = self.planner.recompute_fraction(recompute)
        plan, req = self.planner.pml_parts(prompt, namespace, r, layout)
        return self.runner.prefill_spliced(plan, t0, reserve, keep_cache, recompute=req)

    def plan(self, prompt: str | Path | Prompt, namespace: str | None = None, *,
             recompute: float | str | None = None, layout: PromptLayout | None = None) -> PrefillPlan:
        return self.planner.pml_plan(prompt, namespace, recompute=recompute, layout=layout)

    # -- generation ------------------------------------------------------------------------------
    def engine(self, config: ServingConfig | None = None) -> Engine:
        """``PromptCache.engine``: the serving engine, built on first use; another ``config``
        rebuilds it, refused while it has requests."""
        with self._engine_lock:
            if self._engine is not None and config is not None and config != self._engine.config:
                if self._engine.has_work:
                    raise RuntimeError("PromptCache.engine(config): the engine has requests running; "
                                       "change its settings when it is idle")
                self._engine.close()
                self._engine = None
            if self._engine is None:
                self._engine = Engine(self, config)
            return self._engine

    def prompt_spec(self, prompt, *, use_cache: bool = True, namespace: str | None = None,
                    recompute: float | str | None = None) -> PromptSpec:
        """``PromptCache.prompt_spec``: one prompt as frozen data, checked now."""
        if isinstance(prompt, PromptSpec):
            return prompt
        ns = self.config.namespace_for(namespace)
        if isinstance(prompt, list) and prompt and all(isinstance(m, dict) for m in prompt):
            prompt = self.chat_ids(prompt)
        if isinstance(prompt, (list, tuple)):
            vocab = self.model.config.vocab_size
            if not prompt or not all(isinstance(t, int) and 0 <= t < vocab for t in prompt):
                raise ValueError(f"a token prompt must be a non-empty list of token ids in [0, {vocab})")
            return TokenPrompt(tuple(prompt), ns, reuse=use_cache)
        tree = prompt if isinstance(prompt, Prompt) else parse_prompt(prompt)
        layout = self.planner.layout(tree, ns)
        if not use_cache:
            return TokenPrompt(tuple(layout.token_ids), ns, reuse=False, layout=layout)
        return PmlPrompt(tree, ns, recompute, layout)

    def chat_ids(self, messages: list[dict]) -> list[int]:
        """Token ids of chat messages rendered with the tokenizer's chat template and a generation prompt."""
        out = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        return list(out["input_ids"] if hasattr(out, "keys") else out)
