"""Trees + tokenizer -> spans with token IDs and position IDs (docs/pml.md "Positions"). Torch-free.

* ``spans``: the data (``SchemaLayout``, ``PromptLayout``, ``Span``, ``EncodePass``, ...);
* ``schema``: ``layout_schema``, the walk of a schema in document order;
* ``prompt``: ``layout_prompt``, a prompt's spans against its schema's layout.

Both entry points take ``max_positions`` (the model's context) and refuse what does not fit
with a PMLError naming both numbers, before any model work.
"""

from .prompt import layout_prompt
from .schema import layout_schema
from .spans import EncodePass, ModuleInfo, PromptLayout, SchemaLayout, SchemaSpan, Span, UnionInfo

__all__ = [
    "EncodePass", "ModuleInfo", "PromptLayout", "SchemaLayout", "SchemaSpan", "Span", "UnionInfo",
    "layout_prompt", "layout_schema",
]
