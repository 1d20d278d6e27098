"""promptcache: modular attention reuse (Prompt Cache, Gim et al., MLSys 2024) for transformers LMs.

``from promptcache import PMLError, parse_schema, layout_schema`` needs no torch; ``PromptCache``,
``EngineConfig`` with its sections ``RunnerConfig``, ``StoreConfig``, ``RecomputeConfig``, and
``SamplingParams`` (the engine, ``promptcache.engine``) are imported lazily
on first use. Every error promptcache raises on purpose derives from ``PromptCacheError``
(``errors.py``). A ``str`` is always PML or plain text; a ``pathlib.Path`` is a file.
"""

from .openmp import prefer_shared_machine

prefer_shared_machine()  # OpenMP threads that sleep while they wait: set before torch loads libgomp (openmp.py)

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
