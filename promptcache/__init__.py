"""promptcache: modular attention reuse (Prompt Cache, Gim et al., MLSys 2024) for transformers LMs.

``from promptcache import PMLError, parse_schema, layout_schema`` needs no torch; ``PromptCache``,
``EngineConfig`` with its sections ``RunnerConfig``, ``StoreConfig``, ``RecomputeConfig``, and
``SamplingParams`` (the engine, ``promptcache.engine``) are imported lazily
on first use. Every error promptcache raises on purpose derives from ``PromptCacheError``
(``errors.py``). A ``str`` is always PML or plain text; a ``pathlib.Path`` is a file.
"""

import os as _os
import sys as _sys

# settings of torch's native libraries for a process that shares its machine (cores, memory)
SHARED_MACHINE = {"OMP_WAIT_POLICY": "PASSIVE", "LRU_CACHE_CAPACITY": "256", "ONEDNN_PRIMITIVE_CACHE_CAPACITY": "256"}


def _prefer_shared_machine(environ=_os.environ) -> dict[str, str]:
    """OpenMP settings for a machine that others share, set before torch starts; returns what was
    set (empty when torch is loaded already: libgomp has read its settings).

    torch's CPU kernels run on an OpenMP team (GNU libgomp in PyPI's builds) whose threads meet at
    a barrier after every operation; by default a waiting thread spins, and libgomp reads its wait
    policy once, when torch loads it. Where another process holds a core, the others spin for the
    thread that lost it: four ``DocumentStore.add()`` on SmolLM2 took 9.8 s beside one
    busy-looping thread instead of 1.4 s alone, 2.8 s with sleeping waits (figures:
    eval/results/reliability.md, ``python -m eval.bench_wait_policy``). So ``import promptcache``
    sets ``OMP_WAIT_POLICY=PASSIVE`` unless the environment sets it; ``OMP_WAIT_POLICY=ACTIVE``
    suits cores that are yours alone. The thread count stays torch's (one per physical core;
    ``OMP_NUM_THREADS`` changes it).

    Memory: torch's oneDNN wrapper (ideep, ``LRU_CACHE_CAPACITY``) and oneDNN itself
    (``ONEDNN_PRIMITIVE_CACHE_CAPACITY``) each keep up to 1,024 compiled primitives by default,
    one per matrix shape met, some hundreds of KB each. A server meets a new shape with every new
    count of tokens in a step, so its resident memory grew for minutes after warm-up until both
    caches were full (~490 MB measured over SmolLM2's four linear shapes and 600 token counts).
    256 entries each bound that to ~120 MB at the same decode speed (up to 64 batch sizes of four
    linear shapes stay cached); 64 made decoding 4x slower (the cache thrashed). Both are set
    unless the environment sets them.
    """
    if "torch" in _sys.modules:
        return {}
    chosen = {k: v for k, v in SHARED_MACHINE.items() if k not in environ}
    environ.update(chosen)
    return chosen


_prefer_shared_machine()  # OpenMP threads that sleep while they wait: before torch loads libgomp

from .errors import ConfigError, PromptCacheError  # noqa: E402
from .layout import PromptLayout, SchemaLayout, Span, layout_prompt, layout_schema  # noqa: E402
from .pml import PMLError, parse_prompt, parse_schema  # noqa: E402

__version__ = "0.1.0"

__all__ = [
    "ConfigError", "EngineConfig", "PMLError", "PromptCache", "PromptCacheError", "RecomputeConfig", "RunnerConfig",
    "SamplingParams", "StoreConfig", "PromptLayout", "SchemaLayout", "Span", "layout_prompt", "layout_schema", "parse_prompt", "parse_schema", "print_layout",
]


def print_layout(schema, tokenizer=None) -> None:
    """Print the layout of a schema (PML text as a ``str``, a file as a ``pathlib.Path``, or a
    parsed tree) in one call; defaults to a whitespace tokenizer."""
    from .tokens import WordTokenizer

    print(layout_schema(schema, tokenizer or WordTokenizer()).table())


_ENGINE_NAMES = ("EngineConfig", "PromptCache", "RecomputeConfig", "RunnerConfig", "SamplingParams", "StoreConfig")


def __getattr__(name: str):
    if name in _ENGINE_NAMES:
        from . import engine

        return getattr(engine, name)
    raise AttributeError(f"module 'promptcache' has no attribute {name!r}")
