"""The builder's own checks: argument types and where each node may go (the language rules are
``pml/rules.py``). Every error is a ``PMLError`` with source ``<builder>`` and no line."""

from __future__ import annotations

import re

from ..pml.errors import PMLError
from ..pml.nodes import Module, ModuleRef, Parameter, Role, Text, Union
from ..pml.rules import check_name

SOURCE = "<builder>"
# Characters outside XML 1.0's Char production: XML cannot hold them, even escaped.
_NOT_XML = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\ud800-\udfff\ufffe\uffff]")


def error(reason: str) -> PMLError:
    return PMLError(reason, SOURCE)


def check_type_name(name, what: str) -> None:
    """A str, then the language's name rule."""
    if not isinstance(name, str):
        raise error(f"{what} name must be a string, got {type(name).__name__} {name!r}")
    check_name(name, what, SOURCE, None)


def check_chars(text: str, what: str) -> None:
    m = _NOT_XML.search(text)
    if m:
        raise error(f"{what} {_short(text)} holds U+{ord(m.group()):04X}, a character XML cannot hold")


def _short(text: str) -> str:
    return repr(text if len(text) <= 40 else text[:37] + "...")


def describe(child) -> str:
    if isinstance(child, str):
        return f"text {_short(child)}"
    if isinstance(child, Text):
        return f"text {_short(child.text)}"
    if isinstance(child, (Module, Parameter, ModuleRef)):
        kind = {Module: "module", Parameter: "param", ModuleRef: "ref"}[type(child)]
        return f"{kind}({child.name!r})"
    if isinstance(child, Role):
        return f"{child.role}()"
    if isinstance(child, Union):
        return "union()"
    return f"{type(child).__name__} {child!r}"


def join(children: tuple, sep) -> tuple:
    if not isinstance(sep, str):
        raise error(f"sep must be a string, got {type(sep).__name__} {sep!r}")
    if not sep or len(children) < 2:
        return tuple(children)
    out: list = []
    for c in children:
        if out:
            out.append(sep)
        out.append(c)
    return tuple(out)


def texts(children: tuple) -> list:
    """Strings -> ``Text`` nodes (line None); nodes are kept as they are."""
    return [Text(c, None) if isinstance(c, str) else c for c in children]


def check_children(children: tuple, where: str, allowed: tuple[type, ...], expected: str, text: str = "") -> None:
    """Every child is one of ``allowed`` (``str`` for text); a wrong kind gets an error saying
    where it goes. ``text``: why text is not allowed here."""
    for c in children:
        if isinstance(c, allowed) and not isinstance(c, bool):
            if isinstance(c, str):
                check_chars(c, "text")
            continue
        if isinstance(c, str) and text:
            raise error(f"{describe(c)} in {where}: {text}")
        if isinstance(c, Parameter):
            raise error(f"{describe(c)} in {where}: a parameter belongs directly in a module")
        if isinstance(c, Role):
            raise error(f"{describe(c)} in {where}: roles go at the top level of a Schema or Prompt")
        if isinstance(c, ModuleRef):
            raise error(f"{describe(c)} in {where}: refs import modules in a Prompt (or nest in a ref)")
        if isinstance(c, (Module, Union)) and ModuleRef in allowed:
            raise module_in_prompt(c, where)
        raise error(f"unexpected {describe(c)} in {where} (expected {expected})")


def module_in_prompt(c, where: str) -> PMLError:
    name = f"ref({c.name!r})" if isinstance(c, Module) else "ref(<member>)"
    return error(f"{describe(c)} in {where}: modules are declared in a Schema; import one with {name}")
