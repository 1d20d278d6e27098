"""Tokenizer adapters for the layout: span encoding, BOS, padding and chat-role glue.

Torch-free. The layout accepts anything with ``encode(text) -> list[int]``; ``as_span_tokenizer``
wraps it. Hugging Face tokenizers get ``HFSpanTokenizer``:

* every span is encoded on its own with ``add_special_tokens=False`` (``encode_checked`` refuses
  text that is not valid Unicode with a PMLError before the tokenizer sees it);
* a model that expects BOS (the tokenizer adds it, or its chat template starts with it) gets
  exactly one BOS token, at position 0, as the first anonymous span of the schema; a chat
  template's own leading BOS text is removed from its first glue piece;
* a plain prompt (no schema) without roles gets BOS only when the tokenizer itself adds one to
  text (``plain_bos_ids``): SmolLM2 declares ``<|im_start|>`` as its BOS token but never
  prepends it, so its plain prompts start with their text, as ``tokenizer(text)`` does;
* chat roles are rendered with the tokenizer's chat template: a conversation whose contents are
  sentinels is rendered and split around them, giving the *glue* text before each message's
  content and after the last one. Tokenizers without a chat template use ``PlainRoles``; for a
  Hugging Face tokenizer (which a user expects to bring its own template) this is logged once per
  tokenizer object, as a warning, the first time roles are rendered.
"""

from __future__ import annotations

import logging
import re
import threading
import weakref
from typing import Protocol, Sequence, runtime_checkable

from .pml.errors import PMLError
from .pml.source import check_text

log = logging.getLogger(__name__)

_SENTINEL = "\ue000PC{}\ue001"
_SENTINEL_RE = re.compile("\ue000PC(\\d+)\ue001")


@runtime_checkable
class SpanTokenizer(Protocol):
    bos_ids: tuple[int, ...]  # BOS of a schema (and of a prompt with roles): tokenizer or template
    plain_bos_ids: tuple[int, ...]  # BOS of a plain prompt without roles: only what the tokenizer adds
    pad_id: int

    def encode(self, text: str) -> list[int]: ...

    def render_roles(self, roles: Sequence[str], add_generation_prompt: bool) -> list[str]:
        """Glue pieces for a conversation: len(roles) + 1 strings; piece i precedes message i's
        content, the last piece follows the last content (footer + generation prompt)."""
        ...


class PlainRoles:
    """Documented fallback for tokenizers without a chat template.

    Renders ``System: ...\\nUser: ...\\nAssistant:`` -- each message is ``"{Role}: " + content``,
    messages are separated by a newline, and the generation prompt is ``"\\nAssistant:"``.
    """

    @staticmethod
    def render_roles(roles: Sequence[str], add_generation_prompt: bool) -> list[str]:
        pieces = [("\n" if i else "") + f"{r.capitalize()}: " for i, r in enumerate(roles)]
        pieces.append("\nAssistant:" if add_generation_prompt else "")
        return pieces


class GenericSpanTokenizer(PlainRoles):
    """Anything with ``encode``: no BOS, plain roles, pad from ``pad_token_id`` when present."""

    def __init__(self, tok):
        self.tok = tok
        self.bos_ids = tuple(getattr(tok, "bos_ids", ()) or ())
        self.plain_bos_ids = self.bos_ids
        self.pad_id = _first_int(tok, ("pad_id", "pad_token_id", "unk_token_id", "eos_token_id"), default=0)

    def encode(self, text: str) -> list[int]:
        return list(self.tok.encode(text))


class HFSpanTokenizer:
    """A Hugging Face tokenizer seen as a span tokenizer (see module docstring)."""

    def __init__(self, tok):
        self.tok = tok
        self.pad_id = _first_int(tok, ("pad_token_id", "unk_token_id", "eos_token_id"), default=0)
        bos = tok.bos_token_id
        adds_bos = bos is not None and tok("x").input_ids[:1] == [bos]
        self.bos_ids = (bos,) if bos is not None and (adds_bos or self._template_starts_with_bos()) else ()
        self.plain_bos_ids = (bos,) if adds_bos else ()
        self._cache: dict[tuple, list[str]] = {}

    def _template_starts_with_bos(self) -> bool:
        if not (self.tok.bos_token and getattr(self.tok, "chat_template", None)):
            return False
        try:
            text = self.tok.apply_chat_template([{"role": "user", "content": "x"}], tokenize=False)
        except Exception:  # a template that cannot render one user message says nothing about BOS
            return False
        return isinstance(text, str) and text.startswith(self.tok.bos_token)

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False) if text else []

    def render_roles(self, roles: Sequence[str], add_generation_prompt: bool) -> list[str]:
        key = (tuple(roles), add_generation_prompt)
        if key not in self._cache:
            self._cache[key] = self._render(list(roles), add_generation_prompt)
        return list(self._cache[key])

    def _render(self, roles: list[str], add_generation_prompt: bool) -> list[str]:
        if not getattr(self.tok, "chat_template", None):
            if roles:
                _warn_no_template(self.tok)
            return PlainRoles.render_roles(roles, add_generation_prompt)
        if not roles:
            return [""]
        messages = [{"role": r, "content": _SENTINEL.format(i)} for i, r in enumerate(roles)]
        continue_final = roles[-1] == "assistant" and not add_generation_prompt
        try:
            text = self.tok.apply_chat_template(
                messages,
                tokenize=False,
                add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final,
            )
        except Exception as e:  # templates raise their own errors (e.g. roles must alternate)
            raise PMLError(f"the tokenizer's chat template cannot render roles {roles}: {e}") from None
        parts = _SENTINEL_RE.split(text)
        found = [int(i) for i in parts[1::2]]
        if found != list(range(len(roles))):
            raise PMLError(
                f"the tokenizer's chat template drops or reorders message contents for roles {roles}"
            )
        pieces = parts[0::2]
        if self.bos_ids and self.tok.bos_token and pieces[0].startswith(self.tok.bos_token):
            pieces[0] = pieces[0][len(self.tok.bos_token) :]
        return pieces


_WARNED: "weakref.WeakSet" = weakref.WeakSet()  # tokenizers already warned about (no chat template)
_WARNED_IDS: set[int] = set()  # the same, for tokenizers that cannot be weakly referenced
_WARN_LOCK = threading.Lock()


def _warn_no_template(tok) -> None:
    """Log, once per tokenizer object, that chat roles fall back to ``PlainRoles``."""
    with _WARN_LOCK:
        try:
            if tok in _WARNED:
                return
            _WARNED.add(tok)
        except TypeError:
            if id(tok) in _WARNED_IDS:
                return
            _WARNED_IDS.add(id(tok))
    log.warning("tokenizer %s (%s) has no chat template: chat roles use the plain fallback "
                "'System: ...\\nUser: ...\\nAssistant:' (set tokenizer.chat_template to use the model's format)",
                type(tok).__name__, getattr(tok, "name_or_path", "") or "unnamed")


def _first_int(obj, names: Sequence[str], default: int) -> int:
    for n in names:
        v = getattr(obj, n, None)
        if isinstance(v, int):
            return v
    return default


def encode_checked(tok: SpanTokenizer, text: str, source: str, line: int | None) -> list[int]:
    """``tok.encode(text)``, after refusing text that is not valid Unicode (a lone surrogate)
    with a PMLError naming ``source`` and ``line`` (a tokenizer would raise a TypeError)."""
    check_text(text, "text", source, line)
    return tok.encode(text)


def as_span_tokenizer(tok) -> SpanTokenizer:
    if isinstance(tok, (HFSpanTokenizer, GenericSpanTokenizer)):
        return tok
    if hasattr(tok, "apply_chat_template") and hasattr(tok, "convert_tokens_to_ids"):
        return HFSpanTokenizer(tok)
    if not hasattr(tok, "encode"):
        raise TypeError(f"a tokenizer needs an encode(text) method, got {type(tok).__name__}")
    return GenericSpanTokenizer(tok)


class WordTokenizer(GenericSpanTokenizer):
    """A dependency-free tokenizer for inspecting layouts: one token per word or punctuation mark,
    with ids assigned on first sight. Not for models; it shows positions without a model."""

    _WORD = re.compile(r"\s*\w+|\s*[^\w\s]|\s+")

    def __init__(self):
        self.vocab: dict[str, int] = {"<pad>": 0}
        self.bos_ids = self.plain_bos_ids = ()
        self.pad_id = 0

    def encode(self, text: str) -> list[int]:
        return [self.vocab.setdefault(w, len(self.vocab)) for w in self._WORD.findall(text)]
