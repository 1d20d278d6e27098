"""``Schema`` and ``Prompt`` documents of the builder: checks of the whole tree (the language
rules from ``pml/rules.py``), PML text (``to_pml``), atomic ``save`` and the parser-equivalent
``pml.nodes`` tree (``tree``)."""

from __future__ import annotations

import copy
import hashlib
import os
from pathlib import Path

from lxml import etree

from ..fsutil import atomic_write
from ..pml import nodes as N
from ..pml.whitespace import normalize_whitespace
from ..pml.rules import check_imported_once, check_not_empty, check_roles_only, check_scope_names
from ..pml.rules import resolve_imports
from .check import SOURCE, check_children, check_type_name, describe, error, join, module_in_prompt, texts
from .xml import build, keep_indent, keep_indents
from .xml import pretty as pretty_print


class _Document:
    _root = ""
    children: list

    def to_pml(self, pretty: bool = True) -> str:
        """The PML text: pretty-printed (whitespace-equivalent, see the package docstring) or
        exactly as written (``pretty=False``; the indentation rule aside)."""
        root = etree.Element(self._root, self._attrs())
        for c in self.children:
            build(root, c)
        keep_indents(root)
        if pretty:
            pretty_print(root, 0, start_safe=self._start_safe(), end_safe=True)
        text = etree.tostring(root, encoding="unicode")
        return text + "\n" if pretty else text

    def __str__(self) -> str:
        return self.to_pml()

    def save(self, path: str | os.PathLike) -> Path:
        """Write ``to_pml()`` to ``path`` atomically (``fsutil.atomic_write``: temporary file in the
        same folder, fsync, rename, fsync of the folder), creating missing folders. Returns the path."""
        return atomic_write(path, self.to_pml())

    def _tree_children(self, roles: type) -> list:
        """A normalized copy of the children: adjacent texts joined into runs (the indentation
        rule applied), role nodes as ``roles``, whitespace rule applied as the parser does."""
        children = _runs(copy.deepcopy(self.children), roles)
        normalize_whitespace(children, at_start=self._start_safe())
        return children


def _runs(children: list, roles: type) -> list:
    out: list = []
    for c in children:
        if isinstance(c, N.Text):
            if out and isinstance(out[-1], N.Text):
                out[-1] = N.Text(out[-1].text + c.text, None)
            else:
                out.append(N.Text(c.text, None))
            continue
        if isinstance(c, N.Role):
            c = roles(c.role, c.children, None)
        if isinstance(c, N.Union):
            c.members = [_with_runs(m, roles) for m in c.members]
        elif hasattr(c, "children"):
            c = _with_runs(c, roles)
        out.append(c)
    for i, c in enumerate(out):
        if isinstance(c, N.Text):
            out[i] = N.Text(keep_indent(c.text), None)
    return out


def _with_runs(node, roles: type):
    node.children = _runs(node.children, roles)
    return node


def _number_unions(children: list, counter: list[int]) -> None:
    """Union indices in document order, outer before nested (as the parser numbers them)."""
    for c in children:
        if isinstance(c, N.Union):
            c.index = counter[0]
            counter[0] += 1
            for m in c.members:
                _number_unions(m.children, counter)
        elif isinstance(c, (N.Module, N.Role)):
            _number_unions(c.children, counter)


def _has_src(children: list) -> bool:
    for c in children:
        if isinstance(c, N.Module) and (c.src is not None or _has_src(c.children)):
            return True
        if isinstance(c, N.Union) and _has_src(c.members) or isinstance(c, N.Role) and _has_src(c.children):
            return True
    return False


class Schema(_Document):
    """``<schema name>``: top-level text, modules and unions, or only roles (plus whitespace)."""

    _root = "schema"

    def __init__(self, name: str, *children, sep: str = ""):
        check_type_name(name, "schema")
        self.name = name
        raw = join(children, sep)
        where = f"Schema({name!r})"
        check_children(raw, where, (str, N.Module, N.Union, N.Role), "text, module(), union() or a role")
        for r in raw:
            if isinstance(r, N.Role):
                refs = [c for c in r.children if isinstance(c, N.ModuleRef)]
                if refs:
                    raise error(f"{describe(refs[0])} in {r.role}() of {where}: refs import modules in a Prompt")
        self.children = texts(raw)
        check_roles_only(self.children, SOURCE)
        check_scope_names(self.children, SOURCE, recurse=False)
        check_not_empty(name, self.children, SOURCE, None)

    def _attrs(self) -> dict:
        return {"name": self.name}

    def _start_safe(self) -> bool:
        return True

    def tree(self) -> N.Schema:
        """The ``pml.nodes.Schema`` that parsing ``to_pml()`` gives (digest: sha256 of that text).
        A schema with ``src=`` modules is refused: save it and parse the file."""
        if _has_src(self.children):
            raise error(f"Schema({self.name!r}) reads src= files: save() it and parse the saved file")
        children = self._tree_children(N.Role)
        _number_unions(children, [0])
        digest = hashlib.sha256(self.to_pml().encode("utf-8")).hexdigest()
        return N.Schema(self.name, children, SOURCE, digest, line=None)

    def __repr__(self) -> str:
        return f"Schema({self.name!r}, {len(self.children)} children)"


class Prompt(_Document):
    """``<prompt schema>``: refs, free text and roles. ``schema`` is a name, a builder ``Schema``
    (the refs are then checked against it with the layout's import rules) or None for a
    plain-text prompt."""

    _root = "prompt"

    def __init__(self, schema: "str | Schema | None", *children, sep: str = ""):
        raw = join(children, sep)
        if isinstance(schema, Schema):
            self.schema = schema.name
        elif schema is None:
            self.schema = None
        else:
            check_type_name(schema, "schema")
            self.schema = schema
        where = "Prompt()" if self.schema is None else f"Prompt({self.schema!r})"
        check_children(raw, where, (str, N.ModuleRef, N.Role), "text, ref() or a role")
        for r in raw:
            if isinstance(r, N.Role):
                bad = [c for c in r.children if isinstance(c, (N.Module, N.Union))]
                if bad:
                    raise module_in_prompt(bad[0], f"{r.role}() of {where}")
        self.children = texts(raw)
        refs = self.refs
        if refs and self.schema is None:
            raise error(f"{describe(refs[0])} in a prompt without a schema (name one to import modules)")
        check_imported_once(refs, SOURCE)
        if isinstance(schema, Schema):
            resolve_imports(refs, schema.name, schema.children, SOURCE)

    @property
    def refs(self) -> list[N.ModuleRef]:
        """Top-level refs, those inside roles included, in order."""
        out = []
        for c in self.children:
            if isinstance(c, N.ModuleRef):
                out.append(c)
            elif isinstance(c, N.Role):
                out += [r for r in c.children if isinstance(r, N.ModuleRef)]
        return out

    def _attrs(self) -> dict:
        return {} if self.schema is None else {"schema": self.schema}

    def _start_safe(self) -> bool:
        return self.schema is None  # a prompt with a schema continues it: leading whitespace counts

    def tree(self) -> N.Prompt:
        """The ``pml.nodes.Prompt`` that parsing ``to_pml()`` gives."""
        return N.Prompt(self.schema, self._tree_children(N.PromptRole), SOURCE, line=None)

    def __repr__(self) -> str:
        return f"Prompt({self.schema!r}, {len(self.children)} children)"
