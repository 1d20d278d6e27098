"""Per-family adapters: how position IDs reach attention, KV shapes. See ``base.py``."""

from .base import Adapter, KVSpec, UnsupportedModelError
from .families import REGISTRY, get_adapter, supported_model_types

__all__ = ["Adapter", "KVSpec", "REGISTRY", "UnsupportedModelError", "get_adapter", "supported_model_types"]
