"""Deprecated: ``promptcache.compiled`` moved to ``promptcache.engine.compiled``.

The engine compiles and loads schemas (``PromptCache.compile_schema`` / ``load_compiled``, the
public way); the module moved inside ``engine/`` so that the package layering holds (the engine
called this module and this module called back into the engine). Importing this name still
works and warns; it will be removed.
"""

import warnings

from .engine.compiled import compile_schema, kv_spec_record, load_compiled

warnings.warn("promptcache.compiled moved to promptcache.engine.compiled (or use PromptCache.compile_schema / "
              "load_compiled)", DeprecationWarning, stacklevel=2)

__all__ = ["compile_schema", "kv_spec_record", "load_compiled"]
