"""Schema and prompt trees. Plain data: no tokenizer, no torch.

Every node has a ``line`` (the source line of its tag or text; ``None`` for nodes made by the
builder). Text in parsed trees is already whitespace-normalized (``whitespace.normalize_whitespace``):
a leading ``" "`` on a text or the ``lead_space`` flag of a parameter is the separator that
stood in the source between this span and the previous one.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterator

ROLES = ("system", "user", "assistant")


@dataclass
class Text:
    text: str
    line: int
    verbatim: bool = field(default=False, compare=False)  # src file or plain-text prompt: not dedented


@dataclass
class Parameter:
    name: str
    length: int  # positions reserved for the argument
    scaffold: str  # placeholder text used while encoding (padded to `length`)
    line: int
    lead_space: bool = False  # whitespace stood before the slot: arguments get a leading " "


@dataclass
class Module:
    name: str
    children: list  # Text | Parameter | Module | Union
    line: int
    cache: bool = True
    src: str | None = None

    def submodules(self) -> Iterator["Module"]:
        """Modules directly in this module's scope (union members included)."""
        yield from _scope_modules(self.children)


@dataclass
class Union:
    members: list[Module]
    line: int
    scaffold: str | None = None
    index: int = -1  # unique id within the schema, in document order


@dataclass
class Role:
    role: str  # one of ROLES
    children: list
    line: int


@dataclass
class Schema:
    name: str
    children: list  # Text | Module | Union | Role
    source: str  # file path or "<string>"
    digest: str  # sha256 of the schema text and every `src` file it reads
    line: int = 1

    @property
    def roles(self) -> tuple[str, ...]:
        return tuple(c.role for c in self.children if isinstance(c, Role))

    def submodules(self) -> Iterator[Module]:
        yield from _scope_modules(self.children)


def _scope_modules(children: list) -> Iterator[Module]:
    for c in children:
        if isinstance(c, Module):
            yield c
        elif isinstance(c, Union):
            yield from c.members
        elif isinstance(c, Role):
            yield from _scope_modules(c.children)


@dataclass
class ModuleRef:
    """``<plan days="3"><detail/></plan>`` in a prompt."""

    name: str
    args: dict[str, str]
    children: list["ModuleRef"]
    line: int


@dataclass
class PromptRole:
    role: str
    children: list  # ModuleRef | Text
    line: int


@dataclass
class Prompt:
    schema: str | None  # None: a plain-text prompt
    children: list = field(default_factory=list)  # ModuleRef | Text | PromptRole
    source: str = "<string>"
    line: int = 1  # line of the <prompt> tag
