"""PML text -> schema / prompt trees, with exact errors.

Never recovers from malformed XML. Every error is a ``PMLError`` naming source and line. An
element that breaks a rule is reported and skipped, and reading goes on with its siblings, so one
reading reports each such error of a file (``PMLErrors`` when there are several).

The whitespace rule is in ``whitespace.py`` (one rule for schemas, prompts and ``src`` files).
"""

from __future__ import annotations

import hashlib
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

from .errors import PMLError, SourceFileError, raise_collected
from .nodes import ROLES, Module, ModuleRef, Parameter, Prompt, PromptRole, Role, Schema, Text, Union
from .rules import MAX_PARAMETER_LENGTH, RESERVED, check_name, check_not_empty, check_roles_only
from .rules import check_scope_names, check_union, length_ok
from .source import Lines, check_text, confined_path, content, is_markup, parse_xml, read_source, read_text
from .whitespace import normalize_whitespace

_DIGITS = re.compile(r"^[0-9]+$")

_SCHEMA_ATTRS = {
    "schema": ({"name"}, set()),
    "module": ({"name"}, {"cache", "src"}),
    "union": (set(), {"scaffold"}),
    "parameter": ({"name", "length"}, {"scaffold"}),
    **{r: (set(), set()) for r in ROLES},
}


def _check_attrs(el, source: str, line: int) -> None:
    required, optional = _SCHEMA_ATTRS[el.tag]
    for name in required:
        if name not in el.attrib:
            raise PMLError(f"<{el.tag}> needs attribute '{name}'", source, line)
    for name in el.attrib:
        if name not in required | optional:
            allowed = ", ".join(sorted(required | optional)) or "none"
            raise PMLError(
                f"<{el.tag}> has unknown attribute '{name}' (allowed: {allowed})", source, line
            )


# ---------------------------------------------------------------------------------------------
# Schemas


@dataclass
class _SchemaCtx:
    source: str
    base: Path | None
    digest: "hashlib._Hash"
    lines: Lines
    src_root: Path
    unions: int = 0
    errors: list = field(default_factory=list)  # PMLErrors of skipped elements, in document order


def _kept(errors: list, fn, *args):
    """``fn(*args)``, or None with its PMLError appended to ``errors``: a bad element is reported
    and skipped (a file that cannot be read, exit code 2, still stops the reading)."""
    try:
        return fn(*args)
    except SourceFileError:
        raise
    except PMLError as e:
        errors.append(e)
        return None


def parse_schema(text_or_path: str | os.PathLike, *, allow_src_root: str | Path | None = None) -> Schema:
    """Parse a schema from PML text (a ``str``, never opened) or a file (a ``pathlib.Path``).

    ``src=`` files are read relative to the schema file's folder (the current working directory
    for a schema given as a string) and must lie inside ``allow_src_root``: by default that same
    folder (and below). Only regular UTF-8 files of at most ``source.MAX_FILE_BYTES`` are read.
    An empty schema (no text, no module) is a PMLError.
    """
    text, source, base = read_source(text_or_path, "schema")
    if isinstance(text_or_path, str) and not is_markup(text):
        raise PMLError("schema text must start with '<' (a str is PML text, never a file name: "
                       "pass pathlib.Path(...) to read a file)", source, 1)
    root, lines = parse_xml(text, source)
    line = lines.start(root)
    if root.tag != "schema":
        raise PMLError(f"expected <schema> as the root element, found <{root.tag}>", source, line)
    _check_attrs(root, source, line)
    name = root.get("name")
    check_name(name, "schema", source, line)
    src_root = Path(allow_src_root) if allow_src_root is not None else (base or Path.cwd())
    ctx = _SchemaCtx(source, base, hashlib.sha256(text.encode("utf-8")), lines, src_root)
    children = _schema_children(root, ctx, scope="root")
    if not ctx.errors:  # a schema emptied by skipped elements is not reported as empty
        _kept(ctx.errors, check_not_empty, name, children, source, line)
    _kept(ctx.errors, check_roles_only, children, source)
    _kept(ctx.errors, check_scope_names, children, source)
    raise_collected(ctx.errors)
    normalize_whitespace(children, at_start=True)
    return Schema(name=name, children=children, source=source, digest=ctx.digest.hexdigest(), line=line)


def _schema_children(el, ctx: _SchemaCtx, scope: str) -> list:
    """Children of `el` in document order. scope: 'root' | 'role' | 'module' | 'union'."""
    out: list = []
    for kind, item, line in content(el, ctx.lines, ctx.source):
        if kind == "el":
            node = _kept(ctx.errors, _schema_element, item, ctx, scope)
            if node is not None:
                out.append(node)
        elif scope == "union" and item.strip():
            ctx.errors.append(PMLError("text inside <union> (a union holds only modules)", ctx.source, line))
        else:
            out.append(Text(item, line))
    return out


def _is_empty(el, ctx: _SchemaCtx) -> bool:
    return all(kind == "text" and not item.strip() for kind, item, _ in content(el, ctx.lines, ctx.source))


def _schema_element(el, ctx: _SchemaCtx, scope: str):
    src, line = ctx.source, ctx.lines.start(el)
    if el.tag not in _SCHEMA_ATTRS or el.tag == "schema":
        known = ", ".join(f"<{t}>" for t in _SCHEMA_ATTRS if t != "schema")
        raise PMLError(f"unknown tag <{el.tag}> in a schema (known: {known})", src, line)
    _check_attrs(el, src, line)
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
        if not _is_empty(el, ctx):
            raise PMLError(f"<parameter name='{el.get('name')}'> must be empty", src, line)
        name = el.get("name")
        check_name(name, "parameter", src, line)
        raw = el.get("length").strip()
        if not _DIGITS.match(raw) or not length_ok(int(raw)):
            raise PMLError(
                f"parameter '{name}' has length '{el.get('length')}': expected a positive integer"
                f" (at most {MAX_PARAMETER_LENGTH})",
                src,
                line,
            )
        return Parameter(name, int(raw), el.get("scaffold", ""), line)
    if el.tag == "union":
        index, ctx.unions = ctx.unions, ctx.unions + 1  # numbered in document order: before nested unions
        reported = len(ctx.errors)
        u = Union(_union_members(_schema_children(el, ctx, "union")), line, el.get("scaffold"), index=index)
        if len(ctx.errors) == reported:  # members skipped for their own errors do not count as missing
            check_union(u, src)
        return u
    # <module>
    name = el.get("name")
    check_name(name, "module", src, line)
    cache = el.get("cache", "true").strip().lower()
    if cache not in ("true", "false"):
        raise PMLError(f"module '{name}' has cache='{el.get('cache')}': expected true or false", src, line)
    module = Module(name, [], line, cache=cache == "true", src=el.get("src"))
    if module.src is not None:
        if not _is_empty(el, ctx):
            raise PMLError(f"module '{name}' has both src= and content", src, line)
        module.children = [Text(_read_src(module.src, ctx, line), line, verbatim=True)]
    else:
        module.children = _schema_children(el, ctx, "module")
    return module


def _union_members(children: list) -> list[Module]:
    """The modules of a union. Whitespace between the union's tags and a member counts as a
    separator on that side of the member (the whitespace rule, across tags): it is kept as a
    whitespace-only text at the member's start or end."""
    members = []
    for i, c in enumerate(children):
        if isinstance(c, Module):
            if i > 0 and isinstance(children[i - 1], Text):
                c.children.insert(0, Text(" ", c.line))
            if i + 1 < len(children) and isinstance(children[i + 1], Text):
                c.children.append(Text(" ", c.line))
            members.append(c)
    return members


def _read_src(rel: str, ctx: _SchemaCtx, line: int) -> str:
    path = confined_path(rel, ctx.base or Path.cwd(), ctx.src_root, "src file", ctx.source, line)
    data = read_text(path, f"src file '{rel}' ->", ctx.source, line)
    ctx.digest.update(b"\0src\0" + rel.encode() + b"\0" + data.encode("utf-8"))
    return data


# ---------------------------------------------------------------------------------------------
# Prompts


def parse_prompt(text_or_path: str | os.PathLike) -> Prompt:
    """Parse a prompt: a ``str`` is text and never opened, a ``pathlib.Path`` is a file to read.
    Text starting with '<' is PML; any other text is a plain-text prompt (no schema), even a
    string that happens to name a file. An empty or whitespace-only prompt is a PMLError; a
    prompt that yields no tokens is refused by the layout."""
    if isinstance(text_or_path, str):
        text, source = text_or_path, "<string>"
    else:
        text, source, _ = read_source(text_or_path, "prompt")
    if not is_markup(text):
        check_text(text, "prompt text", source, 1)
        if not text.strip():
            raise PMLError("empty prompt: no text and no <prompt> element", source, 1)
        children = [Text(text, 1, verbatim=True)]
        normalize_whitespace(children, at_start=True)
        return Prompt(schema=None, children=children, source=source)
    root, lines = parse_xml(text, source)
    line = lines.start(root)
    if root.tag != "prompt":
        raise PMLError(f"expected <prompt> as the root element, found <{root.tag}>", source, line)
    for name in root.attrib:
        if name != "schema":
            raise PMLError(f"<prompt> has unknown attribute '{name}' (allowed: schema)", source, line)
    schema = root.get("schema")
    ctx = _PromptCtx(source, lines, has_schema=schema is not None)
    children = _prompt_children(root, ctx, scope="root")
    raise_collected(ctx.errors)
    normalize_whitespace(children, at_start=schema is None)
    return Prompt(schema=schema, children=children, source=source, line=line)


@dataclass
class _PromptCtx:
    source: str
    lines: Lines
    has_schema: bool
    errors: list = field(default_factory=list)  # as _SchemaCtx.errors


def _prompt_children(el, ctx: _PromptCtx, scope: str) -> list:
    """scope: 'root' | 'role' | 'ref'. A module reference holds only nested references."""
    out: list = []
    for kind, item, line in content(el, ctx.lines, ctx.source):
        if kind == "el":
            node = _kept(ctx.errors, _prompt_element, item, ctx, scope)
            if node is not None:
                out.append(node)
        elif scope != "ref":
            out.append(Text(item, line))
        elif item.strip():
            ctx.errors.append(PMLError(
                f"text inside the module reference <{el.tag}> (free text goes between references)",
                ctx.source,
                line,
            ))
    return out


def _prompt_element(el, ctx: _PromptCtx, scope: str):
    source, line = ctx.source, ctx.lines.start(el)
    if el.tag in ROLES:
        if scope != "root":
            raise PMLError(f"<{el.tag}> must be at the top level of the prompt", source, line)
        if el.attrib:
            raise PMLError(f"<{el.tag}> takes no attributes", source, line)
        return PromptRole(el.tag, _prompt_children(el, ctx, "role"), line)
    if el.tag in RESERVED:
        raise PMLError(f"<{el.tag}> is a schema tag and cannot appear in a prompt", source, line)
    if not ctx.has_schema:
        raise PMLError(f"module reference <{el.tag}> in a prompt without schema=", source, line)
    return ModuleRef(el.tag, dict(el.attrib), _prompt_children(el, ctx, "ref"), line)
