"""Whether a layer class's ``forward`` is, text for text, a known transformers form: ``has_form``.

The fused kernels (``rms_norm``, ``fused``) replace a layer's forward only where the class computes
exactly what the kernel computes; comparing the source text (whitespace aside) is the check, so a
family that changes one line (a norm that adds one to its weight, an attention with a sliding
window) keeps its own forward.
"""

from __future__ import annotations

import inspect
import textwrap

__all__ = ["has_form"]

_KNOWN: dict[tuple[type, str], bool] = {}  # (class, form) -> whether its forward is that text


def has_form(cls: type, form: str) -> bool:
    """Whether ``cls.forward``'s source is ``form`` (whitespace aside); False without source."""
    if (cls, form) not in _KNOWN:
        try:
            src = textwrap.dedent(inspect.getsource(cls.forward)).strip()
        except (OSError, TypeError, AttributeError):  # no source (a compiled or generated class): not known
            src = ""
        _KNOWN[cls, form] = " ".join(src.split()) == " ".join(form.split())
    return _KNOWN[cls, form]
