"""The one base class of every error promptcache raises on purpose, and the few generic ones.

No torch, no transformers: importable by the CLI before anything heavy loads. Each class says
with ``exit_code`` what a command line should exit with: 1 for bad input (a schema, prompt,
artifact or setting the user can fix), 2 for the environment (a missing file, no network, no
CUDA). Library errors keep their historical bases too (``PMLError`` and ``ConfigError`` are
``ValueError``s, model-loading errors ``OSError``s), so ``except ValueError`` still catches them.

    try:
        ...
    except PromptCacheError as e:
        sys.exit(print(f"error: {e}") or e.exit_code)
"""

from __future__ import annotations

__all__ = ["ConfigError", "DeviceError", "ModelNotFoundError", "OfflineError", "PromptCacheError"]


class PromptCacheError(Exception):
    """Base of every promptcache error. ``exit_code``: 1 bad input, 2 environment."""

    exit_code: int = 1


class ConfigError(PromptCacheError, ValueError):
    """A bad setting: an ``EngineConfig`` or ``SamplingParams`` field, a dtype name, a namespace."""


class ModelNotFoundError(PromptCacheError, OSError):
    """A model id or directory that cannot be found or read."""

    exit_code = 2


class OfflineError(ModelNotFoundError):
    """A hub model id was asked for while the machine has no network (or HF_HUB_OFFLINE is set)
    and the model is not in the local Hugging Face cache."""


class DeviceError(PromptCacheError, RuntimeError):
    """The requested device is not available here (``device="cuda"`` without CUDA)."""

    exit_code = 2
