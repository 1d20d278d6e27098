"""Builder nodes -> lxml elements -> PML text: the exact writer and the pretty-printer.

``keep_indent`` is the one writing rule the parser needs: a text run whose first line is
indented and which has more lines is written starting with a newline, so the parser removes the
indentation common to *all* its lines (relative indentation of code survives) instead of
treating the first line's indentation as a separator. The pretty-printer's rules are in
``pretty``'s docstring.
"""

from __future__ import annotations

from lxml import etree

from ..pml.nodes import ROLES, Module, ModuleRef, Parameter, PromptRole, Role, Text, Union
from ..pml.whitespace import dedent_text


def keep_indent(run: str) -> str:
    """``run`` with a leading newline when its first line is indented and more lines follow."""
    first, nl, _ = run.partition("\n")
    if nl and first[:1] in (" ", "\t") and first.strip():
        return "\n" + run
    return run


def keep_indents(el) -> None:
    """Apply ``keep_indent`` to every text run (element text and tails) under ``el``, in place."""
    for node in el.iter():
        if node is not el and node.tail:
            node.tail = keep_indent(node.tail)
        if isinstance(node.tag, str) and node.text and len(node.text):
            node.text = keep_indent(node.text)


def build(parent, node) -> None:
    """Append ``node`` (a ``pml.nodes`` object made by the builder) to the lxml element ``parent``."""
    if isinstance(node, Text):
        if not node.text:
            return
        if len(parent):
            parent[-1].tail = (parent[-1].tail or "") + node.text
        else:
            parent.text = (parent.text or "") + node.text
    elif isinstance(node, Parameter):
        attrs = {"name": node.name, "length": str(node.length)}
        if node.scaffold:
            attrs["scaffold"] = node.scaffold
        etree.SubElement(parent, "parameter", attrs)
    elif isinstance(node, Module):
        attrs = {"name": node.name}
        if not node.cache:
            attrs["cache"] = "false"
        if node.src is not None:
            attrs["src"] = node.src
        el = etree.SubElement(parent, "module", attrs)
        for c in node.children:
            build(el, c)
    elif isinstance(node, Union):
        el = etree.SubElement(parent, "union", {} if node.scaffold is None else {"scaffold": node.scaffold})
        for m in node.members:
            build(el, m)
    elif isinstance(node, (Role, PromptRole)):
        el = etree.SubElement(parent, node.role)
        for c in node.children:
            build(el, c)
    elif isinstance(node, ModuleRef):
        el = etree.SubElement(parent, node.name, dict(node.args))
        for c in node.children:
            build(el, c)


_INDENT = "  "


def pretty(el, depth: int, start_safe: bool, end_safe: bool) -> None:
    """Reshape whitespace that cannot change the parse (module docstring), in place.

    The runs of ``el`` are its text and its children's tails. At an edge of a run next to a
    block tag (anything but <parameter>) or at the container's start or end, existing edge
    whitespace is replaced by a newline and indentation (the parser strips a run's edges and only
    asks whether whitespace was there); where there was none, one is added only if the position
    is safe: the container's start or end when the caller says so, before a role, and after a
    role that only whitespace separates from the next role or the end.

    A container's start is "safe" only while no separator can arise there, and the parser keeps
    whitespace seen at a start pending: a union whose members differ in being empty turns it
    into a separator after the union. So whitespace is added at a start only if a span, written
    whitespace or a role comes before any union (``_opens_safely``).
    """
    kids = list(el)
    blocks = [k.tag != "parameter" for k in kids]
    if not any(blocks):
        return
    start_safe = start_safe and _opens_safely(el)
    inner, outer = "\n" + _INDENT * (depth + 1), "\n" + _INDENT * depth
    runs = [el.text or ""] + [k.tail or "" for k in kids]
    n = len(kids)
    for j, r in enumerate(runs):
        if j == 0:
            lead_want, lead_safe = True, start_safe
        else:
            lead_want = blocks[j - 1]
            lead_safe = kids[j - 1].tag in ROLES and not r.strip() and (j == n or kids[j].tag in ROLES)
        if j == n:
            trail_want, trail_safe, trail_ws = True, end_safe, outer
        else:
            trail_want, trail_safe, trail_ws = blocks[j], kids[j].tag in ROLES, inner
        if not r.strip():
            if (lead_want or trail_want) and (r or lead_safe or trail_safe):
                r = trail_ws
        else:
            if trail_want and (r[-1].isspace() or trail_safe):
                r = r.rstrip() + trail_ws  # never changes the run's dedented core
            if lead_want and (r[0].isspace() or lead_safe):
                moved = inner + r.lstrip()
                # A new first line changes which indentation is common to the run's lines
                # (the parser removes it): move the text's start only if its core stays the same.
                if dedent_text(moved).strip() == dedent_text(r).strip():
                    r = moved
        runs[j] = r
    el.text = runs[0] or None
    for k, tail in zip(kids, runs[1:]):
        k.tail = tail or None
    for j, k in enumerate(kids):
        if k.tag in ROLES:
            pretty(k, depth + 1, start_safe=True, end_safe=True)
        elif k.tag == "module":
            pretty(k, depth + 1, start_safe=False, end_safe=False)
        elif k.tag == "union":
            # Whitespace inside a union is a separator at its members' edges: harmless only when
            # whitespace (or a start/end where no separator arises) stands on both sides.
            _pretty_union(k, depth + 1, runs[j][-1:].isspace() and runs[j + 1][:1].isspace())


def _opens_safely(el) -> bool:
    """Whether el's content reaches a span (text, parameter), whitespace the caller wrote, a role
    or its own end before any union or ``src`` module (whose text is unknown here)."""
    return _first(el, top=True) is not False


def _first(el, top: bool = False) -> bool | None:
    """True: safe; False: a union (or src module) first; None: el is empty, look further."""
    if not top:
        if el.tag in ROLES or el.tag == "parameter":
            return True
        if el.tag == "union" or el.get("src") is not None:
            return False
    if el.text:
        return True
    for k in el:
        r = _first(k)
        if r is not None:
            return r
        if k.tail:
            return True
    return True if top else None


def _pretty_union(el, depth: int, spaced: bool) -> None:
    members = list(el)
    if spaced:
        el.text = "\n" + _INDENT * (depth + 1)
        for i, m in enumerate(members):
            m.tail = "\n" + _INDENT * (depth + (i + 1 < len(members)))
    for m in members:
        pretty(m, depth + 1, start_safe=False, end_safe=False)
