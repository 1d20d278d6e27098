"""``PromptCache``: the public face of the engine. It delegates; the work is in the rooms beside it.

    pc = PromptCache(model, tokenizer)
    pc.add_schema(Path("schemas/travel.xml"))         # a str is PML text, a Path a file
    out = pc.generate(Path("examples/travel_tokyo.xml"), max_new_tokens=64)

    outs = pc.generate([prompt_a, prompt_b, [1, 2, 3]])  # a list: continuously batched, in order

Generation (``generate``, ``stream``) runs on the serving core (``core.Engine``: one KV pool, one
packed forward per step): each prompt becomes a request whose plan (``plan``: store lookups,
which stored states are read in place, which tokens run at which position IDs) the scheduler
takes at admission. New tokens attend to every cached entry and to the new tokens before them:
the paper's definition. Generated tokens take positions after the largest position in the
prompt. Several threads may call ``generate`` on one PromptCache: they share its engine.
A prompt that recomputes part of its states runs the chosen tokens as rows of the step
(``plan``). ``prefill`` assembles one prompt in a private buffer (``ModelRunner.prefill_spliced``):
the logits alone, never on the serving path.

Rooms: ``runner.py`` (model, forwards, buffers), ``registry.py`` (encoded schemas, fingerprints,
keys), ``encoder.py`` (schema encoding), ``assemble.py`` (prompt plans), ``sampling.py``,
``request.py``, ``scheduler.py``, ``stream.py`` (decoding), ``results.py``, ``config.py``.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from pathlib import Path

import torch

from ..layout import PromptLayout, SchemaLayout, layout_prompt, layout_schema
from ..kernels import fuse_mlps_and_rotary, fuse_rms_norms
from ..models.packed import pack_linears
from ..pml import parse_prompt
from ..pml.nodes import Prompt
from ..progress import bar_for, progress_for
from ..store import StoreError, build_store
from ..tokens import as_span_tokenizer
from ..tunables import PREWARM_SLACK
from .schemas import compiled
from .schemas.assemble import assemble, leading_exact, moves_last
from .prefill.config import EngineConfig, ServingConfig
from .serving_core.core import Engine
from .schemas.encoder import Progress, SchemaEncoder
from .prefill.plan import PrefillPlan, Segment
from .serving_core.prompts import PmlPrompt, PromptSpec, TokenPrompt
from .prefill.recompute import RecomputeRequest, check_recompute, fraction_of, recompute_request
from .schemas.registry import EncodedSchema, SchemaRegistry
from .serving_core.request import Request
from .prefill.results import Generation, PrefillResult
from .prefill.window_reads import whole_segment, with_whole_states
from .prefill.runner import ModelRunner
from .decoding.sampling import SamplingParams, sampling_params
from .stream import GenerationStream

__all__ = ["PromptCache"]

log = logging.getLogger(__name__)


class PromptCache:
    """Prompt Cache over a loaded ``transformers`` causal LM and its tokenizer."""

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
        self._engine: Engine | None = None
        self._engine_lock = threading.Lock()

    @classmethod
    def from_pretrained(cls, name_or_path: str | Path, device: str = "cpu", dtype: str = "auto",
                        config: EngineConfig | None = None, **load_kwargs) -> "PromptCache":
        """Load a Hugging Face model id or a local directory (see ``models.loading``). ``dtype``
        "auto": the checkpoint's dtype where ``device`` computes it natively, float32 otherwise
        (``models.native_dtype``; logged)."""
        from ..models.loading import load_model  # transformers' Auto classes: loaded only when used

        model, tokenizer = load_model(name_or_path, device=device, dtype=dtype, **load_kwargs)
        return cls(model, tokenizer, config)

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
        """Parse, lay out and encode a schema (only modules not stored yet are encoded).
        On any error the engine is left unchanged. Without ``progress``, encoding shows a bar on
        a terminal and logs otherwise (``promptcache.progress``). ``allow_src_root``: the folder
        ``src=`` files may come from (default: the schema file's folder)."""
        t0 = time.perf_counter()
        layout = layout_schema(schema, self.tok, max_positions=self.adapter.max_positions,
                               allow_src_root=allow_src_root)
        ns = self.config.namespace_for(namespace)
        keys = self.registry.content_keys(layout, ns)
        encoded = self._ensure_states(layout, keys, progress or progress_for(f"encoding {layout.name}"))
        # placed now only when every state was just encoded and still sits in memory: states held
        # by another tier (disk, a remote store) are fetched by the first prompt that needs them,
        # and reading them here would promote them and churn tight memory budgets
        seconds = time.perf_counter() - t0
        in_memory = all(self.store.tier_of(k) in ("device", "host") for k in keys.values())
        return self.register_schema(layout, keys, ns, seconds,
                                    place=in_memory and len(encoded) == len(set(keys.values())))

    def _ensure_states(self, layout: SchemaLayout, keys: dict[int, str], progress: Progress | None = None,
                       fetch: bool = False) -> list[str]:
        """Encode the states no tier holds (local, or shared: fetched on first use, or now with
        ``fetch``); with a shared tier, two processes missing the same states encode them once
        (``TieredStore.ensure``)."""
        dtype = self.runner.stored_spec.dtype  # kv_dtype (the encoder already gives it; .to is then a no-op)

        def encode() -> dict[str, torch.Tensor]:
            return {keys[i]: kv.to(dtype) for i, kv in self.encoder.encode(layout, progress).items()}

        return self.store.ensure(keys.values(), encode, fetch)

    def register_schema(self, layout: SchemaLayout, keys: dict[int, str], namespace: str,
                        seconds: float, place: bool = True) -> EncodedSchema:
        """Make a schema whose states are in ``store`` under ``keys`` usable by prompts (``add_schema``
        and ``load_compiled`` end here). ``place``: copy the default pass's states into a prewarmed
        assembly buffer now (CPU), so the first prompt finds them in place; False leaves states
        held by another tier unread (a lazily loaded artifact, states in a remote store)."""
        entry = self.registry.register(layout, keys, namespace, seconds)
        stored = [Segment(keys[i], None, entry.positions[i], load=functools.partial(self._stored_states, keys[i]))
                  for i in entry.default_order()] if place else []
        self.runner.prewarm(layout.end + PREWARM_SLACK, stored)
        return entry

    def _stored_states(self, key: str) -> torch.Tensor:
        return self.store.get(key)[0]

    def compile(self, schema: str | Path, out_dir: str | Path, progress: Progress | None = None,
                namespace: str | None = None, source_name: str | None = None) -> Path:
        """Encode a schema and write it as a compiled artifact (safetensors + manifest.json)."""
        return compiled.compile_schema(self, schema, out_dir, progress, namespace, source_name)

    def load_compiled(self, path: str | Path, schema: str | Path | None = None, recompile: bool = False,
                      namespace: str | None = None, verify: bool = False, convert: bool = False) -> EncodedSchema:
        """Register a compiled schema; its states stay on disk (memory-mapped, checksummed) until
        used. ``schema``: the schema source, to check the artifact was compiled from it.
        A mismatch (model, tokenizer, schema text) is refused unless ``recompile``; ``verify``
        reads and checks every state now instead of on first use. An artifact stored in another
        dtype than this engine's ``kv_dtype`` is refused unless ``convert``: its states are then
        read, checked and converted into memory now (no recompile)."""
        return compiled.load_compiled(self, path, schema, recompile, namespace, verify, convert)

    def encode_span(self, token_ids: list[int], start: int = 0) -> torch.Tensor:
        """States of tokens encoded alone (no context) at positions start..: [L, 2, H, n, D]."""
        return self.encoder.encode_alone(token_ids, start)

    def schema(self, name: str, namespace: str | None = None) -> EncodedSchema:
        return self.registry.get(name, self.config.namespace_for(namespace))

    @property
    def schemas(self) -> list[str]:
        return self.registry.names(self.config.namespace)

    # -- prompts ---------------------------------------------------------------------------------
    def layout(self, prompt: str | Path | Prompt, namespace: str | None = None) -> PromptLayout:
        """The prompt's ordered spans (``.kind``, ``.name``, ``.token_ids``, ``.position_ids``)."""
        tree = prompt if isinstance(prompt, Prompt) else parse_prompt(prompt)
        ns = self.config.namespace_for(namespace)
        schema = self.schema(tree.schema, ns).layout if tree.schema is not None else None
        return layout_prompt(tree, schema, self.tok, max_positions=self.adapter.max_positions)

    def prefill(self, prompt: str | Path | Prompt, reserve: int = 0, keep_cache: bool = False,
                namespace: str | None = None, *, recompute: float | str | None = None,
                layout: PromptLayout | None = None) -> PrefillResult:
        """Assemble the prompt's cache and run its new tokens: next-token logits and statistics.

        ``keep_cache=True`` hands the assembled cache to the caller (``result.cache``, with room
        for ``reserve`` more tokens); call ``release(result)`` when done so it can be reused.
        A stored state that vanished (shared tier down, evicted) or fails verification is
        re-encoded with the schema's other missing states and the plan retried once (a warning).

        ``recompute``: ``"auto"`` or the fraction of the drifted cached tokens computed afresh in
        the prompt's own context (None: ``config.recompute.fraction``, default ``"auto"``; see
        ``engine/prefill/recompute.py``). ``"auto"`` recomputes nothing for an exact layout and
        ``AUTO_FRACTION`` of the drifted tokens otherwise; 1.0 equals a plain forward over the
        prompt's tokens in prompt order at the layout's positions. ``res.exact`` and
        ``res.recomputed_tokens`` say what the answer is. ``layout``: the prompt's layout when the
        caller has it already (``PmlPrompt``), so it is not computed twice."""
        t0 = time.perf_counter()
        r = self.recompute_fraction(recompute)
        layout = self.layout(prompt, namespace) if layout is None else layout
        entry = self.schema(layout.schema.name, namespace) if layout.schema is not None else None
        plan = self._assemble(layout, entry)
        req = None
        if r > 0 and not plan.exact:  # exact plans (and r = 0) skip this walk over the layout
            req = recompute_request(layout, leading_exact(layout, entry), r, self.config.recompute.selection,
                                    moves_last(layout))
        plan = self._readable(plan, entry, req)
        return self.runner.prefill_spliced(plan, t0, reserve, keep_cache, recompute=req)

    def plan(self, prompt: str | Path | Prompt, namespace: str | None = None, *,
             recompute: float | str | None = None, layout: PromptLayout | None = None) -> PrefillPlan | None:
        """The prompt as a ``PrefillPlan`` for the serving scheduler: its stored states (read in
        place from the store's tensors, or promoted into the KV pool) and its new tokens. A prompt
        that recomputes part of its cached states (a drifted layout under ``"auto"``, or any layout
        with ``recompute`` > 0 that is not exact) runs the chosen tokens as rows of the step in
        prompt order (``engine/prefill/ordered.py``), its other states read like any plan's."""
        r = self.recompute_fraction(recompute)
        layout = self.layout(prompt, namespace) if layout is None else layout
        entry = self.schema(layout.schema.name, namespace) if layout.schema is not None else None
        plan = self._assemble(layout, entry)
        if r > 0 and not plan.exact:  # exact plans (and r = 0) skip the walk over the layout
            req = recompute_request(layout, leading_exact(layout, entry), r, self.config.recompute.selection,
                                    moves_last(layout))
            return self.runner.recompute_plan(self._readable(plan, entry, req), req)
        return self._readable(plan, entry)

    def _assemble(self, layout: PromptLayout, entry: EncodedSchema | None) -> PrefillPlan:
        """``assemble.assemble``; a stored state that vanished (shared tier down or evicted) or
        failed verification is re-encoded with the schema's other missing states, once."""
        try:
            return assemble(layout, entry, self.store)
        except StoreError as e:
            if entry is None:
                raise
            log.warning("schema '%s': a stored state cannot be used (%s); re-encoding what is missing", entry.name, e)
            self._ensure_states(entry.layout, entry.keys, fetch=True)
            return assemble(layout, entry, self.store)

    def _readable(self, plan: PrefillPlan, entry: EncodedSchema | None, req: RecomputeRequest | None = None):
        """``plan`` with the stored states its readers need more of than a trimming tier kept
        (window-aware storage: a reader before a module, a recomputed token inside one) encoded
        again, so the prompt reads what whole states give (``prefill/window_reads.py``)."""
        if entry is None or self.store.windows is None:
            return plan
        fresh: dict[int, torch.Tensor] = {}
        index = {k: i for i, k in entry.keys.items()}

        def whole(seg: Segment) -> Segment:
            if not fresh:  # one encode of the schema gives every span
                fresh.update(self.encoder.encode(entry.layout))
            return whole_segment(seg, fresh[index[seg.key.removesuffix("[:-1]")]][:, :, :, :seg.n])

        return with_whole_states(plan, self.store.windows, whole, req)

    def recompute_fraction(self, recompute: float | str | None) -> float:
        """The fraction a call uses: ``None`` means ``config.recompute.fraction``; else checked to be
        ``"auto"`` (``AUTO_FRACTION`` of the drifted tokens) or a fraction in [0, 1]."""
        return fraction_of(self.config.recompute.fraction if recompute is None else check_recompute(recompute))

    def run_spliced(self, plan: PrefillPlan, t0: float | None = None, reserve: int = 0, keep_cache: bool = False,
                    *, recompute: RecomputeRequest | None = None) -> PrefillResult:
        """A plan the caller made (stored segments in KV order, new tokens at their positions),
        assembled in a private buffer and run: ``DocumentStore.prefill`` (the logits alone; its
        served prompts are planned into the pool). ``recompute``: a request from
        ``recompute.recompute_request``."""
        return self.runner.prefill_spliced(plan, t0, reserve, keep_cache, recompute=recompute)

    def prefill_baseline(self, prompt, namespace: str | None = None) -> PrefillResult:
        """Full prefill of the prompt's tokens (prompt order, positions 0..n-1), stock model path."""
        t0 = time.perf_counter()
        layout = self.layout(prompt, namespace)
        return self.runner.prefill_plain(layout.token_ids, t0, layout)

    def release(self, result: PrefillResult) -> None:
        """Return a kept cache (``prefill(keep_cache=True)``) for reuse by later prompts."""
        self.runner.release(result.cache)
        result.cache = None

    def clear_buffers(self) -> None:
        """Drop the free assembly buffers: the next prompt allocates and copies everything (benchmarks)."""
        self.runner.clear_buffers()

    def forget_placement(self) -> None:
        """Keep the buffers, forget what they hold: the next prompt copies every module (benchmarks)."""
        self.runner.forget_placement()

    # -- generation ------------------------------------------------------------------------------
    def engine(self, config: ServingConfig | None = None) -> Engine:
        """The serving core ``generate`` and ``stream`` run on, built on first use. ``config``: its
        pool and step settings (default ``ServingConfig()``); a different one rebuilds it, which
        is refused while it has requests."""
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

    def generate(self, prompt, params: SamplingParams | None = None, *, use_cache: bool = True,
                 namespace: str | None = None, recompute: float | str | None = None,
                 progress: bool | None = None, **sampling_kwargs) -> Generation | list[Generation]:
        """Generate text after the prompt, or after each prompt of a list (continuously batched on
        the serving core; a list of Generations in the same order).

        A prompt is PML (a ``str`` of PML or plain text, a ``Path`` to a PML file, a parsed
        ``Prompt``), token ids (``list[int]``, positions 0..n-1, reusing stored prefix blocks), chat
        messages (``list[dict]`` with ``role`` and ``content``, rendered with the tokenizer's chat
        template and a generation prompt) or a ``PromptSpec`` (``DocumentStore`` builds those). A
        list of token ids or of messages is ONE prompt; a list of prompts is a batch.

        ``params`` and/or keywords (``max_new_tokens``, ``temperature``, ``top_p``, ``top_k``,
        ``repetition_penalty``, ``stop``, ``seed``) set the sampling of every prompt.
        ``use_cache=False`` is the baseline: the same tokens in prompt order at contiguous
        positions, nothing reused. ``recompute``: as in ``prefill``. ``progress``: a bar over the
        prompts (default: for a batch, where stderr is a terminal). A prompt that fails raises its
        error once the batch has finished."""
        batch = _is_batch(prompt)
        prompts = list(prompt) if batch else [prompt]
        params = sampling_params(params, **sampling_kwargs)  # validates before any work
        self.recompute_fraction(recompute)
        engine = self.engine()
        reqs = [Request(self.prompt_spec(p, use_cache=use_cache, namespace=namespace, recompute=recompute),
                        params, self.tokenizer) for p in prompts]
        bar = bar_for("generating", "prompts") if (batch if progress is None else progress) else None
        engine.run(reqs, bar)
        for r in reqs:
            if r.error is not None:
                raise r.error
        outs = [r.generation() for r in reqs]
        return outs if batch else outs[0]

    def stream(self, prompt, params: SamplingParams | None = None, *, use_cache: bool = True,
               namespace: str | None = None, recompute: float | str | None = None, **sampling_kwargs) -> GenerationStream:
        """Text pieces as they are decoded (one prompt, same arguments as ``generate``); after the
        loop, ``.result`` holds the Generation with its statistics."""
        params = sampling_params(params, **sampling_kwargs)  # validates before any work
        self.recompute_fraction(recompute)
        spec = self.prompt_spec(prompt, use_cache=use_cache, namespace=namespace, recompute=recompute)
        return GenerationStream(self.engine(), Request(spec, params, self.tokenizer))

    def prompt_spec(self, prompt, *, use_cache: bool = True, namespace: str | None = None,
                    recompute: float | str | None = None) -> PromptSpec:
        """One prompt (any form ``generate`` takes) as the request's ``PromptSpec``, checked now:
        PML is parsed and laid out (an unknown schema or a prompt past the context fails here)."""
        if isinstance(prompt, PromptSpec):
            return prompt
        ns = self.config.namespace_for(namespace)
        if isinstance(prompt, list) and prompt and all(isinstance(m, dict) for m in prompt):
            prompt = self.chat_ids(prompt)
        if isinstance(prompt, (list, tuple)):
            vocab = self.model.config.vocab_size
            if not prompt or not all(isinstance(t, int) and 0 <= t < vocab for t in prompt):
                raise ValueError(f"a token prompt must be a non-empty list of token ids in [0, {vocab})")
            return TokenPrompt(self, tuple(prompt), ns, self.engine().prefix if use_cache else None)
        tree = prompt if isinstance(prompt, Prompt) else parse_prompt(prompt)
        layout = self.layout(tree, ns)
        if not use_cache:
            return TokenPrompt(self, tuple(layout.token_ids), ns, None, layout)
        return PmlPrompt(self, tree, ns, recompute, layout)

    def chat_ids(self, messages: list[dict]) -> list[int]:
        """Token ids of chat messages rendered with the tokenizer's chat template and a generation prompt."""
        out = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        return list(out["input_ids"] if hasattr(out, "keys") else out)


def _is_batch(prompt) -> bool:
    """A list of prompts (a list of token ids or of chat messages is one prompt)."""
    if not isinstance(prompt, list):
        return False
    return not (prompt and all(isinstance(x, int) for x in prompt)) and \
        not (prompt and all(isinstance(x, dict) for x in prompt))
