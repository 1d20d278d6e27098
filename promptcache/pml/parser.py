"""PML text -> schema / prompt trees, with exact errors.

Never recovers from malformed XML. Every error is a ``PMLError`` naming source and line.

Whitespace rule (one rule for schemas, prompts and ``src`` files):
  * Inside a text run, text is kept verbatim (newlines and indentation included).
  * At the edges of runs, whitespace is a separator: a run's leading and trailing whitespace is
    removed, and when any whitespace stood between two spans (at the end of the first, at the
    start of the second, or as a whitespace-only run between them, across tags) the second span
    starts with exactly one space. A parameter slot preceded by whitespace gives its argument
    (and placeholder) that leading space.
  * No separator is added at the start of a schema, at the start of a role's content (the chat
    template places its own), or at the start of a prompt without a schema.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from pathlib import Path

from lxml import etree

from .errors import PMLError
from .nodes import ROLES, Module, ModuleRef, Parameter, Prompt, PromptRole, Role, Schema, Text, Union

_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_.-]*$")
RESERVED = frozenset({"schema", "prompt", "module", "union", "parameter", *ROLES})

_SCHEMA_ATTRS = {
    "schema": ({"name"}, set()),
    "module": ({"name"}, {"cache", "src"}),
    "union": (set(), {"scaffold"}),
    "parameter": ({"name", "length"}, {"scaffold"}),
    **{r: (set(), set()) for r in ROLES},
}


def read_source(text_or_path: str | Path, kind: str) -> tuple[str, str, Path | None]:
    """Return (text, source name, base directory). Strings starting with '<' are PML text."""
    if isinstance(text_or_path, str) and text_or_path.lstrip().startswith("<"):
        return text_or_path, "<string>", None
    path = Path(text_or_path)
    if not path.is_file():
        raise PMLError(f"{kind} file not found: {path}", str(path))
    return path.read_text(encoding="utf-8"), str(path), path.parent


def _parse_xml(text: str, source: str) -> etree._Element:
    parser = etree.XMLParser(
        remove_comments=True, remove_pis=True, resolve_entities=False, no_network=True, recover=False
    )
    try:
        return etree.fromstring(text.encode("utf-8"), parser)
    except etree.XMLSyntaxError as e:
        msg = (e.msg or str(e)).strip()
        raise PMLError(f"malformed XML: {msg}", source, e.lineno or None) from None


def _check_attrs(el, source: str) -> None:
    required, optional = _SCHEMA_ATTRS[el.tag]
    for name in required:
        if name not in el.attrib:
            raise PMLError(f"<{el.tag}> needs attribute '{name}'", source, el.sourceline)
    for name in el.attrib:
        if name not in required | optional:
            allowed = ", ".join(sorted(required | optional)) or "none"
            raise PMLError(
                f"<{el.tag}> has unknown attribute '{name}' (allowed: {allowed})", source, el.sourceline
            )


def _check_name(name: str, what: str, source: str, line: int) -> None:
    if not _NAME.match(name):
        raise PMLError(f"{what} name '{name}' is not a valid XML name", source, line)
    if what == "module" and name in RESERVED:
        raise PMLError(f"module name '{name}' is reserved (it is a PML tag)", source, line)


def _tail_line(el) -> int:
    """Best line estimate for an element's tail text: the line its closing tag ends on."""
    last = el
    while len(last):
        last = last[-1]
    return (last.sourceline or 1) + (last.text or "").count("\n")


# ---------------------------------------------------------------------------------------------
# Schemas


@dataclass
class _SchemaCtx:
    source: str
    base: Path | None
    digest: "hashlib._Hash"
    unions: int = 0


def parse_schema(text_or_path: str | Path) -> Schema:
    """Parse a schema from PML text or a file path."""
    text, source, base = read_source(text_or_path, "schema")
    root = _parse_xml(text, source)
    if root.tag != "schema":
        raise PMLError(f"expected <schema> as the root element, found <{root.tag}>", source, root.sourceline)
    _check_attrs(root, source)
    name = root.get("name")
    _check_name(name, "schema", source, root.sourceline)
    ctx = _SchemaCtx(source, base, hashlib.sha256(text.encode("utf-8")))
    children = _schema_children(root, ctx, scope="root")
    roles = [c for c in children if isinstance(c, Role)]
    if roles:
        for c in children:
            if not isinstance(c, Role) and not (isinstance(c, Text) and not c.text.strip()):
                raise PMLError(
                    "content outside a role in a schema that uses roles (<system>/<user>/<assistant>)",
                    source,
                    getattr(c, "line", root.sourceline),
                )
    _check_scope_names(children, source)
    normalize_whitespace(children, at_start=True)
    return Schema(name=name, children=children, source=source, digest=ctx.digest.hexdigest(), line=root.sourceline)


def _schema_children(el, ctx: _SchemaCtx, scope: str) -> list:
    """Children of `el` in document order. scope: 'root' | 'role' | 'module' | 'union'."""
    out: list = []
    if el.text:
        out.append(Text(el.text, el.sourceline))
    for child in el:
        out.append(_schema_element(child, ctx, scope))
        if child.tail:
            out.append(Text(child.tail, _tail_line(child)))
    if scope == "union":
        for c in out:
            if isinstance(c, Text) and c.text.strip():
                raise PMLError("text inside <union> (a union holds only modules)", ctx.source, c.line)
    return out


def _schema_element(el, ctx: _SchemaCtx, scope: str):
    src, line = ctx.source, el.sourceline
    if el.tag not in _SCHEMA_ATTRS or el.tag == "schema":
        known = ", ".join(f"<{t}>" for t in _SCHEMA_ATTRS if t != "schema")
        raise PMLError(f"unknown tag <{el.tag}> in a schema (known: {known})", src, line)
    _check_attrs(el, src)
    if scope == "union" and el.tag != "module":
        raise PMLError(f"<{el.tag}> inside <union> (a union holds only modules)", src, line)
    if el.tag in ROLES:
        if scope != "root":
            raise PMLError(f"<{el.tag}> must be at the top level of the schema", src, line)
        return Role(el.tag, _schema_children(el, ctx, "role"), line)
    if el.tag == "parameter":
        if scope in ("root", "role"):
            raise PMLError(
                f"parameter '{el.get('name')}' outside a module (parameters belong to modules)", src, line
            )
        if len(el) or (el.text or "").strip():
            raise PMLError(f"<parameter name='{el.get('name')}'> must be empty", src, line)
        name = el.get("name")
        _check_name(name, "parameter", src, line)
        raw = el.get("length").strip()
        if not raw.isdigit() or int(raw) < 1:
            raise PMLError(
                f"parameter '{name}' has length '{el.get('length')}': expected a positive integer", src, line
            )
        return Parameter(name, int(raw), el.get("scaffold", ""), line)
    if el.tag == "union":
        members = [c for c in _schema_children(el, ctx, "union") if isinstance(c, Module)]
        if not members:
            raise PMLError("<union> has no <module> members", src, line)
        scaffold = el.get("scaffold")
        if scaffold is not None and scaffold not in {m.name for m in members}:
            names = ", ".join(m.name for m in members)
            raise PMLError(f"union scaffold '{scaffold}' is not one of its members ({names})", src, line)
        ctx.unions += 1
        return Union(members, line, scaffold, index=ctx.unions - 1)
    # <module>
    name = el.get("name")
    _check_name(name, "module", src, line)
    cache = el.get("cache", "true").strip().lower()
    if cache not in ("true", "false"):
        raise PMLError(f"module '{name}' has cache='{el.get('cache')}': expected true or false", src, line)
    module = Module(name, [], line, cache=cache == "true", src=el.get("src"))
    if module.src is not None:
        if len(el) or (el.text or "").strip():
            raise PMLError(f"module '{name}' has both src= and content", src, line)
        module.children = [Text(_read_src(module.src, ctx, line), line)]
    else:
        module.children = _schema_children(el, ctx, "module")
    return module


def _read_src(rel: str, ctx: _SchemaCtx, line: int) -> str:
    path = (ctx.base or Path.cwd()) / rel
    try:
        data = path.read_text(encoding="utf-8")
    except OSError as e:
        raise PMLError(f"src file '{rel}' cannot be read ({e.strerror or e})", ctx.source, line) from None
    ctx.digest.update(b"\0src\0" + rel.encode() + b"\0" + data.encode("utf-8"))
    return data


def _check_scope_names(children: list, source: str) -> None:
    """Module names are unique per scope (union members included); parameters unique per module."""
    seen: dict[str, int] = {}
    params: dict[str, int] = {}
    for c in _flatten_scope(children):
        if isinstance(c, Module):
            if c.name in seen:
                raise PMLError(
                    f"duplicate module name '{c.name}' in one scope (first at line {seen[c.name]})", source, c.line
                )
            seen[c.name] = c.line
            _check_scope_names(c.children, source)
        elif isinstance(c, Parameter):
            if c.name in params:
                raise PMLError(
                    f"duplicate parameter name '{c.name}' in one module (first at line {params[c.name]})",
                    source,
                    c.line,
                )
            params[c.name] = c.line


def _flatten_scope(children: list):
    for c in children:
        if isinstance(c, Union):
            yield from c.members
        elif isinstance(c, Role):
            yield from _flatten_scope(c.children)
        else:
            yield c


# ---------------------------------------------------------------------------------------------
# Whitespace


class _WS:
    def __init__(self, at_start: bool):
        self.pending = False  # whitespace seen since the last span
        self.at_start = at_start  # no separator before the next span

    def copy(self) -> "_WS":
        c = _WS(self.at_start)
        c.pending = self.pending
        return c


def normalize_whitespace(children: list, at_start: bool) -> None:
    """Apply the whitespace rule in place (module docstring); drops whitespace-only texts."""
    _norm(children, _WS(at_start))


def _norm(children: list, st: _WS) -> None:
    kept = []
    for c in children:
        if isinstance(c, Text):
            raw, core = c.text, c.text.strip()
            if not core:
                st.pending = st.pending or bool(raw)
                continue
            lead = (st.pending or raw[0].isspace()) and not st.at_start
            c.text = (" " if lead else "") + core
            st.pending, st.at_start = raw[-1].isspace(), False
        elif isinstance(c, Parameter):
            c.lead_space = st.pending and not st.at_start
            st.pending = st.at_start = False
        elif isinstance(c, (Module, ModuleRef)):
            _norm(c.children, st)
        elif isinstance(c, Union):
            entry, after = st, []
            for m in c.members:
                s = entry.copy()
                _norm(m.children, s)
                after.append(s)
            # after the union: separated if any member ended in whitespace
            st.pending = entry.pending and all(s.at_start for s in after) or any(s.pending for s in after)
            st.at_start = all(s.at_start for s in after)
        elif isinstance(c, (Role, PromptRole)):
            inner = _WS(at_start=True)
            _norm(c.children, inner)
            st.pending, st.at_start = False, False
        kept.append(c)
    children[:] = kept


# ---------------------------------------------------------------------------------------------
# Prompts


def parse_prompt(text_or_path: str | Path) -> Prompt:
    """Parse a prompt. Text not starting with '<' is a plain-text prompt (no schema)."""
    if isinstance(text_or_path, str) and not text_or_path.lstrip().startswith("<"):
        if "\n" in text_or_path or not Path(text_or_path).is_file():
            children = [Text(text_or_path, 1)]
            normalize_whitespace(children, at_start=True)
            return Prompt(schema=None, children=children)
    text, source, _ = read_source(text_or_path, "prompt")
    root = _parse_xml(text, source)
    if root.tag != "prompt":
        raise PMLError(f"expected <prompt> as the root element, found <{root.tag}>", source, root.sourceline)
    for name in root.attrib:
        if name != "schema":
            raise PMLError(f"<prompt> has unknown attribute '{name}' (allowed: schema)", source, root.sourceline)
    schema = root.get("schema")
    children = _prompt_children(root, source, scope="root", has_schema=schema is not None)
    normalize_whitespace(children, at_start=schema is None)
    return Prompt(schema=schema, children=children, source=source)


def _prompt_children(el, source: str, scope: str, has_schema: bool) -> list:
    out: list = []
    if el.text and el.text.strip() and scope == "ref":
        raise PMLError(f"text inside the module reference <{el.tag}>", source, el.sourceline)
    if el.text:
        out.append(Text(el.text, el.sourceline))
    for child in el:
        out.append(_prompt_element(child, source, scope, has_schema))
        if child.tail:
            if child.tail.strip() and scope == "ref":
                raise PMLError(f"text inside the module reference <{el.tag}>", source, _tail_line(child))
            out.append(Text(child.tail, _tail_line(child)))
    if scope == "ref":
        out = [c for c in out if not isinstance(c, Text)]
    return out


def _prompt_element(el, source: str, scope: str, has_schema: bool):
    line = el.sourceline
    if el.tag in ROLES:
        if scope != "root":
            raise PMLError(f"<{el.tag}> must be at the top level of the prompt", source, line)
        if el.attrib:
            raise PMLError(f"<{el.tag}> takes no attributes", source, line)
        return PromptRole(el.tag, _prompt_children(el, source, "role", has_schema), line)
    if el.tag in RESERVED:
        raise PMLError(f"<{el.tag}> is a schema tag and cannot appear in a prompt", source, line)
    if not has_schema:
        raise PMLError(f"module reference <{el.tag}> in a prompt without schema=", source, line)
    return ModuleRef(el.tag, dict(el.attrib), _prompt_children(el, source, "ref", has_schema), line)
