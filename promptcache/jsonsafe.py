"""JSON from untrusted bytes (artifact manifests, states file headers, document indexes, Redis
headers): ``loads`` refuses nesting past ``MAX_DEPTH`` with a ValueError, the error every reader
already turns into its own refusal, instead of a RecursionError (``json`` recurses per level) or
a structure deep enough to overflow a later recursive walk (``json.dumps`` of a manifest hash)."""

from __future__ import annotations

import json

MAX_DEPTH = 64  # promptcache writes at most 4 levels


def loads(data: str | bytes, max_depth: int = MAX_DEPTH):
    """``json.loads(data)``; a ValueError when nested deeper than ``max_depth``."""
    try:
        doc = json.loads(data)
    except RecursionError:
        raise ValueError(f"JSON nested deeper than {max_depth} levels") from None
    stack = [(doc, 1)]
    while stack:  # iterative: a depth check must not recurse either
        value, depth = stack.pop()
        if depth > max_depth:
            raise ValueError(f"JSON nested deeper than {max_depth} levels")
        if isinstance(value, dict):
            stack.extend((v, depth + 1) for v in value.values())
        elif isinstance(value, list):
            stack.extend((v, depth + 1) for v in value)
    return doc
