"""A document of a ``DocumentStore`` and the two errors the store raises."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..errors import PromptCacheError

__all__ = ["Document", "DocumentStoreError", "UnknownDocumentError"]


class UnknownDocumentError(PromptCacheError, KeyError):
    """A document id that is not in the store."""

    exit_code = 1

    def __str__(self) -> str:
        return str(self.args[0])


class DocumentStoreError(PromptCacheError, RuntimeError):
    """A persisted document store cannot be used as it is (model, tokenizer or files)."""

    exit_code = 1


@dataclass(frozen=True)
class Document:
    id: str
    text: str
    metadata: dict = field(default_factory=dict)
    n_tokens: int = 0
    digest: str = ""  # sha256 of the token ids: names the states file
    token_ids: tuple[int, ...] = field(default=(), repr=False, compare=False)
