"""Constrained decoding: JSON (any object, or one JSON Schema) or tagged JSON values (tool
calls, ``tags_processor``) through xgrammar, as vLLM does.

``json_processor(tokenizer, vocab_size, schema)`` returns a transformers ``LogitsProcessor`` for
ONE request: each call first accepts the token sampled after the previous call (the last id of
``input_ids``, which holds the request's generated tokens at least), then sets every token the
grammar does not allow next to -inf. Once the grammar is complete only its stop tokens (EOS)
remain, so generation ends with a whole JSON value; ``max_tokens`` can still cut it short
(``finish_reason`` "length"), as with every server.

Decisions: the JSON is compact (``any_whitespace=False``): a small model let free between tokens
tends to emit whitespace until ``max_tokens``. xgrammar is optional (the ``structured`` extra) and imported on first use; a
tokenizer's grammar compiler is built once and kept (``_compiler``); compiled grammars are
cached by schema text. A schema xgrammar cannot compile is a ``ConstraintError``; without
xgrammar an ``ImportError`` says which extra to install.
"""

from __future__ import annotations

import functools
import json
import threading
from dataclasses import dataclass

import torch
from transformers import LogitsProcessor

from ...errors import PromptCacheError

__all__ = ["ConstraintError", "Tag", "json_processor", "tags_processor"]

_lock = threading.Lock()


class ConstraintError(PromptCacheError, ValueError):
    """The constraint cannot be built: a schema xgrammar cannot compile."""

    exit_code = 1


def json_processor(tokenizer, vocab_size: int, schema: dict | None = None) -> LogitsProcessor:
    """A fresh processor constraining one generation to JSON (``schema`` None: any JSON object)."""
    text = json.dumps({"type": "object"} if schema is None else schema, sort_keys=True)
    return _GrammarProcessor(_compiled(tokenizer, vocab_size, text))


@dataclass(frozen=True)
class Tag:
    """``begin`` + a JSON value valid against ``schema`` + ``end``, e.g. a tool call."""

    begin: str
    schema: dict
    end: str


def tags_processor(tokenizer, vocab_size: int, tags: list[Tag], *, separator: str, trigger: str,
                   required: bool, single: bool) -> LogitsProcessor:
    """A fresh processor for an answer of tagged JSON values (tool calls).

    ``required``: the answer is one or more tags (one if ``single``) joined by ``separator`` and
    nothing else. Otherwise it is free text in which ``trigger`` (a start of every ``begin``) opens
    a tag that must then be completed; ``single``: the answer ends after the first tag. The JSON
    inside is compact like the rest of this module's (", " and ": " separators)."""
    xgr = _xgrammar()
    items = []
    for t in tags:
        try:  # compiled alone first, so a bad schema is named
            grammar = str(xgr.Grammar.from_json_schema(json.dumps(t.schema, sort_keys=True), any_whitespace=False))
        except (RuntimeError, ValueError) as e:
            raise ConstraintError(f"the JSON schema after {t.begin!r} cannot be compiled into a grammar: {e}") from None
        items.append({"type": "tag", "begin": t.begin, "content": {"type": "grammar", "grammar": grammar}, "end": t.end})
    fmt = ({"type": "tags_with_separator", "tags": items, "separator": separator, "at_least_one": True,
            "stop_after_first": single} if required else
           {"type": "triggered_tags", "triggers": [trigger], "tags": items, "at_least_one": False,
            "stop_after_first": single})
    text = json.dumps({"type": "structural_tag", "format": fmt}, sort_keys=True)
    return _GrammarProcessor(_compiled_tags(tokenizer, vocab_size, text))


def _xgrammar():
    try:
        import xgrammar
    except ImportError:
        raise ImportError("JSON output needs xgrammar: pip install 'promptcache[structured]'") from None
    return xgrammar


@functools.lru_cache(maxsize=8)
def _compiler(tokenizer, vocab_size: int):
    xgr = _xgrammar()
    return xgr.GrammarCompiler(xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size))


@functools.lru_cache(maxsize=64)
def _compiled(tokenizer, vocab_size: int, schema: str):
    with _lock:  # the compiler is shared between the server's threads
        compiler = _compiler(tokenizer, vocab_size)
        try:
            return compiler.compile_json_schema(schema, any_whitespace=False)
        except (RuntimeError, ValueError) as e:
            raise ConstraintError(f"the JSON schema cannot be compiled into a grammar: {e}") from None


@functools.lru_cache(maxsize=64)
def _compiled_tags(tokenizer, vocab_size: int, structural_tag: str):
    with _lock:
        compiler = _compiler(tokenizer, vocab_size)
        try:
            return compiler.compile_structural_tag(structural_tag)
        except (RuntimeError, ValueError) as e:
            raise ConstraintError(f"the tool calls cannot be compiled into a grammar: {e}") from None


class _GrammarProcessor(LogitsProcessor):
    def __init__(self, compiled):
        xgr = _xgrammar()
        self.xgr, self.matcher = xgr, xgr.GrammarMatcher(compiled)
        self.mask = xgr.allocate_token_bitmask(1, compiled.tokenizer_info.vocab_size)  # [1, ceil(V / 32)] int32
        self.started = False
        self.out = None  # the masked scores' buffer: a fresh [1, V] every step cost ms on CPU (page faults)

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        """``input_ids`` [1, n] (its last id: the token sampled after the previous call);
        ``scores`` [1, V] float32 on CPU."""
        if self.started and not self.matcher.is_terminated():
            token = int(input_ids[0, -1])
            if not self.matcher.accept_token(token):
                raise ConstraintError(f"token {token} was sampled against the grammar")
        self.started = True
        if not self.matcher.is_terminated():
            self.matcher.fill_next_token_bitmask(self.mask)
        if self.out is None or self.out.shape != scores.shape:
            self.out = torch.empty(scores.shape, dtype=scores.dtype)  # [1, V] on CPU, reused every step
        self.out.copy_(scores)  # never the caller's logits in place (they give the logprobs)
        self.xgr.apply_token_bitmask_inplace(self.out, self.mask)
        return self.out.to(scores.device)
