"""``EngineConfig``: the engine's settings by concern, each concern one frozen dataclass.

    EngineConfig(runner=RunnerConfig(kv_dtype="bfloat16"),
                 store=StoreConfig(host_budget=4 << 30, spill_dir="spill"),
                 recompute=RecomputeConfig(fraction=0.2),
                 namespace="tenant-a")

Decisions:
- One owner per setting, no copies: ``RunnerConfig`` (the model's forwards: device, encoding
  chunks, stored dtype, copies, packed linears), ``StoreConfig`` (``store/config.py``: budgets,
  tiers, spill folder, remote), ``RecomputeConfig`` (how much drifted context is computed afresh
  and which tokens), and ``namespace`` (tenancy: salts every key, so it belongs to no concern
  below it). Each class validates itself on construction (``ConfigError`` naming the field).
- Option and environment variable names are the leaves' flat names (``--host-budget``,
  ``PROMPTCACHE_RECOMPUTE``): ``settings.leaves`` walks the sections; ``RecomputeConfig.fraction``
  has the flat name ``recompute``. In Python a setting is read and written in its section only
  (``cfg.store.host_budget``, ``EngineConfig(store=StoreConfig(host_budget=...))``); a flat keyword
  is a TypeError naming the section that owns it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, fields

from ...errors import ConfigError
from ...settings import leaves, nested, setting
from ...store.config import StoreConfig
from ...tunables import BLOCK_SIZE
from .budget import AUTO, DEFAULT_SELECTION, check_recompute

__all__ = ["EngineConfig", "RecomputeConfig", "RunnerConfig", "ServingConfig", "check_namespace"]

KV_DTYPES = (None, "float32", "bfloat16", "float16")
_NAMESPACE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:@-]{0,127}")


def check_namespace(namespace: object) -> str:
    """A valid namespace, or ConfigError (a ValueError). Namespaces salt every content key, so an empty or
    malformed one must never fall back to another tenant's (the default) states."""
    if not isinstance(namespace, str) or not _NAMESPACE.fullmatch(namespace):
        raise ConfigError(f"bad namespace {namespace!r}: expected 1-128 characters of letters, digits and "
                         "'._:@-', starting with a letter or digit (None means the engine's default namespace)")
    return namespace


@dataclass(frozen=True)
class RunnerConfig:
    """How the model runs: where, in what chunks, what it stores states as."""

    device: str | None = setting(None, "Device the model runs on (default: the model's).")
    encode_chunk: int = setting(2048, "Tokens per forward while encoding a schema.")
    encode_batch_bytes: int = setting(256 << 20, "KV bytes a batched encoding forward may allocate (a size).")
    kv_dtype: str | None = setting(
        None, "dtype of stored module states: float32, bfloat16 or float16 (default: the model's).")
    overlap_copies: bool = setting(
        False, "On a GPU, copy host-held states in layer groups on a side stream beside the forward (helps "
               "GPU-bound forwards).")
    # CPU, float32: every nn.Linear of the model computes through oneDNN with its weight packed once
    # (models/packed.py: faster decode steps, within float32 rounding of the stock forward; one more
    # copy of the linear weights in memory; eval/results/design_figures.md), and Llama-form layers run
    # their RMSNorm, SiLU MLP activation and rotary embedding in one native pass each (kernels/)
    packed_linear: bool = setting(
        False, "CPU, float32 (or bfloat16 where the CPU has bfloat16 instructions): run every linear layer "
               "through oneDNN with its weight packed once, and Llama-form RMSNorm, SiLU MLP activation and "
               "rotary embedding in one native pass each (faster steps; within rounding of the stock forward; one more copy of the linear weights in "
               "memory).")
    # serving steps of few tokens run through torch.compile (engine/serving_core/graphs.py): on a CPU one graph
    # with symbolic sizes, on a GPU padded buckets captured as CUDA graphs. Off by default: it adds
    # the compiles to a server's start, for slightly faster steps on a CPU (eval/results/compile.md)
    compile: bool = setting(
        False, "Compile serving steps of few tokens (decode, short prefills) with torch.compile: on a CPU one "
               "graph with symbolic sizes, compiled at start; on a GPU padded buckets as CUDA graphs. Compiled "
               "graphs are kept on disk (inductor's cache).")
    # decode steps run over persistent buffers, padded to buckets, captured as CUDA graphs on a GPU and
    # replayed (engine/serving_core/graphs.py, CapturedSteps); any other step runs as before. Off by default: not yet
    # measured on a GPU (docs/gpu.md); on a CPU the same step runs uncaptured (no gain: for tests)
    cuda_graphs: bool = setting(
        False, "Run decode steps over persistent buffers padded to bucket sizes, captured as CUDA graphs on a GPU "
               "(one graph a bucket, at its first step) and replayed; other steps run as before. On a CPU the "
               "same step runs uncaptured. With compile on too, that step is compiled whole, its attention "
               "inside the graph.")

    def __post_init__(self):
        if isinstance(self.encode_chunk, bool) or not isinstance(self.encode_chunk, int) or self.encode_chunk < 1:
            raise ConfigError(f"RunnerConfig.encode_chunk must be an integer >= 1, got {self.encode_chunk!r}")
        if not isinstance(self.encode_batch_bytes, int) or self.encode_batch_bytes < 0:
            raise ConfigError(f"RunnerConfig.encode_batch_bytes must be >= 0 bytes, got {self.encode_batch_bytes!r}")
        if self.kv_dtype not in KV_DTYPES:
            raise ConfigError(f"RunnerConfig.kv_dtype must be one of {', '.join(map(str, KV_DTYPES))}, "
                              f"got {self.kv_dtype!r}")


@dataclass(frozen=True)
class ServingConfig:
    """The serving core's settings (``engine.Engine``: the pool, the step budget, backpressure).
    ``PromptCache.engine(config)`` takes one; ``promptcache serve`` has one option per field,
    generated from the field as every settings class's are (``ServerConfig.serving``).
    Validated on construction: counts >= 1, times > 0."""

    kv_pool_tokens: int = setting(32768, "KV pool size in tokens: running requests' own tokens and shared blocks; a "
                                  "request waits for room instead of running out of memory (CPU: pages are used "
                                  "only when written).")
    block_size: int = setting(BLOCK_SIZE, "Tokens per KV pool block and prefix-reuse block.")
    max_num_batched_tokens: int = setting(512, "Tokens one engine step may run: a token per decoding request plus "
                                          "prefill chunks (a long prompt delays the others' next tokens by one "
                                          "chunk's forward).")
    max_num_seqs: int = setting(256, "Requests running at once; the rest wait in arrival order.")
    max_unread: int = setting(256, "Unread events a streaming request may have before it is paused.")
    pause_timeout: float = setting(30.0, "Seconds a paused request waits for its reader before it is cancelled.")

    def __post_init__(self):
        for f in fields(self):
            v = getattr(self, f.name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or v <= 0 or (f.type == "int" and not isinstance(v, int)):
                raise ConfigError(f"ServingConfig.{f.name} must be {'an integer >= 1' if f.type == 'int' else '> 0'}, "
                                  f"got {v!r}")


@dataclass(frozen=True)
class RecomputeConfig:
    """Drifted cached tokens computed afresh: ``fraction`` "auto" (exact layouts none, drifted ones
    a measured budget: engine/prefill/recompute.py AUTO_FRACTION) or a fraction in [0, 1] (0: the paper's
    splice); ``selection`` which tokens (engine/prefill/recompute.py SELECTIONS)."""

    fraction: float | str = setting(
        AUTO, "Drifted cached tokens computed afresh per prompt: auto (exact prompts none, drifted ones a measured "
              "budget) or a fraction in [0, 1] (0: the paper's splice).", flat="recompute")
    selection: str = setting(DEFAULT_SELECTION, "Which drifted cached tokens recompute chooses.",
                             flat="recompute_selection")

    def __post_init__(self):
        try:
            object.__setattr__(self, "fraction", check_recompute(self.fraction, "RecomputeConfig.fraction (--recompute)"))
            from .recompute import check_selection  # the registry of selections (torch)

            check_selection(self.selection)
        except ValueError as e:
            raise ConfigError(str(e)) from None


@dataclass(frozen=True, init=False)
class EngineConfig:
    """Engine settings by concern (see the module's docstring). Budgets are bytes of stored
    module states per tier (None: unbounded); on a CPU-only engine device memory is host memory
    and ``store.host_budget`` applies."""

    TITLE = "Engine (EngineConfig)"  # the --help heading of its own fields (settings.sections)

    runner: RunnerConfig = nested(RunnerConfig, "Runner (EngineConfig.runner)")
    store: StoreConfig = nested(StoreConfig, "Store (EngineConfig.store)")
    recompute: RecomputeConfig = nested(RecomputeConfig, "Recompute (EngineConfig.recompute)")
    namespace: str = setting("default", "Cache namespace: states are never shared across namespaces.")

    def __init__(self, runner: RunnerConfig | None = None, store: StoreConfig | None = None,
                 recompute: RecomputeConfig | None = None, namespace: str = "default", **unknown):
        if unknown:
            raise TypeError(f"EngineConfig() got unexpected keyword arguments {', '.join(sorted(unknown))}"
                            + _owners(unknown))
        parts = {"runner": runner or RunnerConfig(), "store": store or StoreConfig(),
                 "recompute": recompute or RecomputeConfig()}
        for name, part in parts.items():
            cls = _SECTIONS[name]
            if not isinstance(part, cls):
                raise ConfigError(f"EngineConfig.{name} must be a {cls.__name__}, got {type(part).__name__} {part!r}"
                                  + (f" (write {cls.__name__}(fraction={part!r}))" if name == "recompute" else ""))
            object.__setattr__(self, name, part)
        object.__setattr__(self, "namespace", check_namespace(namespace))

    def namespace_for(self, namespace: str | None) -> str:
        """The namespace a call uses: ``None`` means this config's; anything else must be valid
        (an empty string is an error, never the default)."""
        return self.namespace if namespace is None else check_namespace(namespace)


_SECTIONS = {"runner": RunnerConfig, "store": StoreConfig, "recompute": RecomputeConfig}
# flat name -> (section, field): every leaf below a section (to name the owner of a misplaced keyword)
FLAT = {leaf.name: leaf.path for leaf in leaves(EngineConfig) if len(leaf.path) == 2}


def _owners(keywords) -> str:
    """Where keywords that are a section's settings belong (empty when none is)."""
    owned = []
    for k in sorted(k for k in keywords if k in FLAT):
        section, field = FLAT[k]
        owned.append(f"{k} is {_SECTIONS[section].__name__}.{field}: "
                     f"EngineConfig({section}={_SECTIONS[section].__name__}({field}=...))")
    return f" ({'; '.join(owned)})" if owned else ""
