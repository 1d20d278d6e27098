"""Per-family adapters: how position IDs (and custom masks) reach attention, KV shapes.

``base.py`` the adapter contract (forward with slot writes and masks, limits, self-check);
``kinds.py`` rotary / learned / ALiBi adapters; ``families.py`` the registry and ``get_adapter``;
``masks.py`` slot-write masks; ``relocate.py`` moving stored states (builds on the others, which
never import it); ``loading.py``, ``embedded.py`` getting a model.
"""

from .base import Adapter, KVSpec, UnsupportedModelError
from .families import REGISTRY, adapter_class, get_adapter, supported_model_types

__all__ = ["Adapter", "KVSpec", "REGISTRY", "UnsupportedModelError", "adapter_class", "get_adapter",
           "supported_model_types"]
