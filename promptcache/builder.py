"""Build PML schemas and prompts in Python instead of writing XML by hand. Torch-free.

::

    from promptcache.builder import Schema, Prompt, module, union, param, system, user, assistant, ref

    s = Schema("travel",
        system("You are a travel planner."),
        user(module("plan", "Plan a trip of ", param("days", length=4), " days."),
             union(module("paris", "Paris is ..."), module("tokyo", "Tokyo is ..."), scaffold="paris"),
             module("budget", "Keep it cheap.", cache=False),
             module("code", src="files/main.py"),   # read relative to the saved schema file
             sep="\\n"))
    s.save("schemas/travel.xml")                  # atomic; str(s) / s.to_pml() give the text
    p = Prompt(s, ref("plan", days="3"), ref("tokyo"), " Highlight the food.", user("Any tips?"))
    p.save("examples/travel_food.xml")            # Prompt("travel", ...) works too, unchecked

**Joining.** The children of a schema, prompt, role or module are laid side by side exactly as
given: the builder adds no whitespace, so ``module("plan", "Plan a trip of ", param(...),
" days.")`` is ``<module name="plan">Plan a trip of <parameter .../> days.</module>``, and two
modules given one after the other touch (``...days.</module><union>``: no separator between
their texts). Under the PML whitespace rule (``promptcache/pml/parser.py``) any whitespace at a
boundary is one separating space and none is none, so write the spaces you mean, or pass
``sep=" "`` (any whitespace will do, ``sep="\\n"`` reads better) to put a string between
consecutive children. A union holds only modules: put separators in the member texts or
around the union. Text reaches the model as the same text typed into a PML file would:
adjacent strings (and ``sep``) form one text run; a run that starts right after its tag
(the usual case here) is kept as written, so ``"def f():\n    return 1"`` arrives as is, while
a run that starts with a newline loses the indentation common to its lines.

**Output.** ``to_pml()`` (also ``str()``) pretty-prints by default, adding or reshaping
whitespace only where the whitespace rule makes it meaningless: whitespace the caller wrote at
the edge of a text next to a module, union, role or ref tag becomes a newline and indentation
(any whitespace there is the same single separator); a newline is also added where no
separator can arise: at the start of a schema, of a role's content or of a prompt without a
schema, before a closing schema, prompt or role tag, and around roles. A union's members go on
their own lines only when whitespace already stands on both sides of the union. Text is never
touched inside a run, and a run's first line is moved onto a line of its own only when the
parser's indentation removal then gives the same text. ``to_pml(pretty=False)`` writes
exactly the caller's text; both parse to the same tree (tests/test_builder.py checks this on
random trees). Escaping is lxml's: ``&``, ``<``, quotes and newlines, tabs and carriage returns
in attribute values all survive a round trip.

**Validation.** Every constructor checks its arguments at once and raises ``PMLError`` (a
``ValueError``) saying what is wrong: names that are not XML names, reserved module names,
duplicate names in a scope, a parameter length that is not a positive int, an empty union or
one holding text, a parameter outside a module, a role below the top level, refs in schemas
or modules and modules in prompts, text inside a ref, non-string ref arguments, a module
imported twice, characters XML cannot hold. A ``Prompt`` given a builder ``Schema`` is also
checked against it (unknown modules, missing or unknown arguments, two members of one union).
"""

from __future__ import annotations

import os
import re
import secrets
from dataclasses import dataclass
from pathlib import Path

from lxml import etree

from .pml.errors import PMLError
from .pml.nodes import ROLES
from .pml.parser import dedent_text
from .pml.rules import MAX_PARAMETER_LENGTH, RESERVED
from .pml.rules import NAME as _NAME

__all__ = [
    "Module", "Param", "Prompt", "Ref", "Role", "Schema", "Union",
    "assistant", "module", "param", "ref", "system", "union", "user",
]

_SOURCE = "<builder>"
# Characters outside XML 1.0's Char production: XML cannot hold them, even escaped.
_NOT_XML = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\ud800-\udfff\ufffe\uffff]")


def _error(reason: str) -> PMLError:
    return PMLError(reason, _SOURCE)


def _check_name(name, what: str) -> None:
    if not isinstance(name, str):
        raise _error(f"{what} name must be a string, got {type(name).__name__} {name!r}")
    if not _NAME.match(name):
        raise _error(f"{what} name {name!r} is not a valid XML name ([A-Za-z_][A-Za-z0-9_.-]*)")
    if what in ("module", "ref") and name in RESERVED:
        raise _error(f"{what} name {name!r} is reserved (it is a PML tag)")


def _check_chars(text: str, what: str) -> None:
    m = _NOT_XML.search(text)
    if m:
        raise _error(f"{what} {_short(text)} holds U+{ord(m.group()):04X}, a character XML cannot hold")


def _short(text: str) -> str:
    return repr(text if len(text) <= 40 else text[:37] + "...")


def _describe(child) -> str:
    if isinstance(child, str):
        return f"text {_short(child)}"
    if isinstance(child, (Module, Param, Ref)):
        return f"{type(child).__name__.lower()}({child.name!r})"
    if isinstance(child, Role):
        return f"{child.role}()"
    if isinstance(child, Union):
        return "union()"
    return f"{type(child).__name__} {child!r}"


def _join(children: tuple, sep) -> tuple:
    if not isinstance(sep, str):
        raise _error(f"sep must be a string, got {type(sep).__name__} {sep!r}")
    if not sep or len(children) < 2:
        return tuple(children)
    out: list = []
    for c in children:
        if out:
            out.append(sep)
        out.append(c)
    return tuple(out)


def _check_children(children: tuple, where: str, allowed: tuple[type, ...], expected: str, text: str = "") -> None:
    """Every child is one of ``allowed`` (``str`` for text); a wrong kind gets an error saying
    where it goes. ``text``: why text is not allowed here."""
    for c in children:
        if isinstance(c, allowed):
            if isinstance(c, str):
                _check_chars(c, "text")
            continue
        if isinstance(c, str) and text:
            raise _error(f"{_describe(c)} in {where}: {text}")
        if isinstance(c, Param):
            raise _error(f"{_describe(c)} in {where}: a parameter belongs directly in a module")
        if isinstance(c, Role):
            raise _error(f"{_describe(c)} in {where}: roles go at the top level of a Schema or Prompt")
        if isinstance(c, Ref):
            raise _error(f"{_describe(c)} in {where}: refs import modules in a Prompt (or nest in a ref)")
        if isinstance(c, (Module, Union)) and Ref in allowed:
            raise _module_in_prompt(c, where)
        raise _error(f"unexpected {_describe(c)} in {where} (expected {expected})")


def _module_in_prompt(c, where: str) -> PMLError:
    name = f"ref({c.name!r})" if isinstance(c, Module) else "ref(<member>)"
    return _error(f"{_describe(c)} in {where}: modules are declared in a Schema; import one with {name}")


def _scope(children) -> list[tuple["Module", "Union | None"]]:
    """Modules of one scope: union members count in the scope holding the union; roles open none."""
    out = []
    for c in children:
        if isinstance(c, Module):
            out.append((c, None))
        elif isinstance(c, Union):
            out += [(m, c) for m in c.members]
        elif isinstance(c, Role):
            out += _scope(c.children)
    return out


def _check_unique(names, what: str, where: str) -> None:
    seen = set()
    for n in names:
        if n in seen:
            raise _error(f"duplicate {what} {n!r} in {where}")
        seen.add(n)


# ---------------------------------------------------------------------------------------------
# Nodes. Build them with the lowercase functions; they are immutable and checked on creation.


@dataclass(frozen=True)
class Param:
    """``<parameter name length scaffold/>``: a slot of ``length`` positions inside a module."""

    name: str
    length: int
    scaffold: str = ""

    def __post_init__(self):
        _check_name(self.name, "parameter")
        n = self.length
        if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_PARAMETER_LENGTH:
            raise _error(
                f"param({self.name!r}) has length {n!r}: expected a positive int (at most {MAX_PARAMETER_LENGTH})"
            )
        if not isinstance(self.scaffold, str):
            raise _error(f"param({self.name!r}) scaffold must be a string, got {type(self.scaffold).__name__}")
        _check_chars(self.scaffold, f"param({self.name!r}) scaffold")


@dataclass(frozen=True)
class Module:
    """``<module name cache src>``: children are text, ``Param``, ``Module`` and ``Union``."""

    name: str
    children: tuple = ()
    cache: bool = True
    src: str | None = None

    def __post_init__(self):
        _check_name(self.name, "module")
        where = f"module({self.name!r})"
        if not isinstance(self.cache, bool):
            raise _error(f"{where} cache must be True or False, got {self.cache!r}")
        if self.src is not None:
            if not isinstance(self.src, str) or not self.src:
                raise _error(f"{where} src must be a non-empty path, got {self.src!r}")
            _check_chars(self.src, f"{where} src")
            if self.children:
                raise _error(f"{where} has both src= and content (its text comes from the file)")
        _check_children(self.children, where, (str, Param, Module, Union), "text, param(), module() or union()")
        _check_unique((m.name for m, _ in _scope(self.children)), "module name", where)
        _check_unique((p.name for p in self.children if isinstance(p, Param)), "parameter name", where)


@dataclass(frozen=True)
class Union:
    """``<union scaffold>``: alternative modules; a prompt imports at most one member."""

    members: tuple[Module, ...]
    scaffold: str | None = None

    def __post_init__(self):
        _check_children(
            self.members, "union()", (Module,), "module()",
            "a union holds only modules (put text in a member, or around the union)",
        )
        if not self.members:
            raise _error("union() has no members (a union holds at least one module)")
        names = [m.name for m in self.members]
        _check_unique(names, "module name", "union()")
        if self.scaffold is not None and self.scaffold not in names:
            raise _error(f"union scaffold {self.scaffold!r} is not one of its members ({', '.join(names)})")


@dataclass(frozen=True)
class Role:
    """``<system>``/``<user>``/``<assistant>``: schema content (text, modules, unions) or prompt
    content (text, refs); which one is checked by the ``Schema`` or ``Prompt`` holding it."""

    role: str
    children: tuple = ()

    def __post_init__(self):
        if self.role not in ROLES:
            raise _error(f"unknown role {self.role!r} (roles: {', '.join(ROLES)})")
        where = f"{self.role}()"
        _check_children(self.children, where, (str, Module, Union, Ref), "text, module(), union() or ref()")
        kinds = {type(c) for c in self.children} & {Module, Union, Ref}
        if Ref in kinds and len(kinds) > 1:
            raise _error(f"{where} mixes schema content (module/union) with prompt content (ref)")
        _check_unique((m.name for m, _ in _scope(self.children)), "module name", where)
        _check_unique((r.name for r in self.children if isinstance(r, Ref)), "import of module", where)


@dataclass(frozen=True)
class Ref:
    """A module imported by a prompt: ``<plan days="3"><detail/></plan>``. ``args`` are
    ``(parameter, argument)`` pairs; ``children`` are nested refs."""

    name: str
    children: tuple = ()
    args: tuple[tuple[str, str], ...] = ()

    def __post_init__(self):
        _check_name(self.name, "ref")
        where = f"ref({self.name!r})"
        for k, v in self.args:
            _check_name(k, f"{where} argument")
            if not isinstance(v, str):
                raise _error(f"argument {k!r} of {where} must be a string, got {type(v).__name__} {v!r}")
            _check_chars(v, f"argument {k!r} of {where}")
        _check_children(
            self.children, where, (Ref,), "ref()",
            "a ref holds only nested refs (free text goes between refs)",
        )
        _check_unique((r.name for r in self.children), "import of module", where)


def param(name: str, length: int, scaffold: str = "") -> Param:
    """A parameter slot of ``length`` positions; ``scaffold`` fills it while encoding."""
    return Param(name, length, scaffold)


def module(name: str, /, *children, cache: bool = True, src: str | os.PathLike | None = None, sep: str = "") -> Module:
    """A module. ``cache=False``: never stored. ``src``: text from a file relative to the schema file."""
    return Module(name, _join(children, sep), cache, os.fspath(src) if isinstance(src, os.PathLike) else src)


def union(*members: Module, scaffold: str | None = None) -> Union:
    """Alternatives sharing positions; ``scaffold`` names the member standing in while encoding."""
    return Union(tuple(members), scaffold)


def system(*children, sep: str = "") -> Role:
    return Role("system", _join(children, sep))


def user(*children, sep: str = "") -> Role:
    return Role("user", _join(children, sep))


def assistant(*children, sep: str = "") -> Role:
    return Role("assistant", _join(children, sep))


def ref(name: str, /, *children: Ref, **args: str) -> Ref:
    """Import module ``name`` in a prompt; keyword arguments fill its parameters, positional
    refs import its nested modules: ``ref("plan", ref("detail"), days="3")``."""
    return Ref(name, tuple(children), tuple(args.items()))


# ---------------------------------------------------------------------------------------------
# Documents


class _Document:
    _root = ""

    def to_pml(self, pretty: bool = True) -> str:
        """The PML text: pretty-printed (whitespace-equivalent, see the module docstring) or
        exactly as written (``pretty=False``)."""
        root = etree.Element(self._root, self._attrs())
        for c in self.children:
            _build(root, c)
        if pretty:
            _pretty(root, 0, start_safe=self._start_safe(), end_safe=True)
        text = etree.tostring(root, encoding="unicode")
        return text + "\n" if pretty else text

    def __str__(self) -> str:
        return self.to_pml()

    def save(self, path: str | os.PathLike) -> Path:
        """Write ``to_pml()`` to ``path`` atomically (a temporary file in the same folder, then a
        rename), creating missing folders. Returns the path."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        data = self.to_pml().encode("utf-8")
        tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)  # mode as umask allows
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        return path


class Schema(_Document):
    """``<schema name>``: top-level text, modules and unions, or only roles (plus whitespace)."""

    _root = "schema"

    def __init__(self, name: str, *children, sep: str = ""):
        _check_name(name, "schema")
        self.name = name
        self.children = _join(children, sep)
        where = f"Schema({name!r})"
        _check_children(self.children, where, (str, Module, Union, Role), "text, module(), union() or a role")
        roles = [c for c in self.children if isinstance(c, Role)]
        for r in roles:
            refs = [c for c in r.children if isinstance(c, Ref)]
            if refs:
                raise _error(f"{_describe(refs[0])} in {r.role}() of {where}: refs import modules in a Prompt")
        if roles:
            for c in self.children:
                if not isinstance(c, Role) and not (isinstance(c, str) and not c.strip()):
                    raise _error(f"{_describe(c)} outside a role in {where}, which uses roles (only whitespace may be)")
        _check_unique((m.name for m, _ in _scope(self.children)), "module name", f"the top level of {where}")

    def _attrs(self) -> dict:
        return {"name": self.name}

    def _start_safe(self) -> bool:
        return True

    def __repr__(self) -> str:
        return f"Schema({self.name!r}, {len(self.children)} children)"


class Prompt(_Document):
    """``<prompt schema>``: refs, free text and roles. ``schema`` is a name, a builder ``Schema``
    (the refs are then checked against it) or None for a plain-text prompt."""

    _root = "prompt"

    def __init__(self, schema: "str | Schema | None", *children, sep: str = ""):
        self.children = _join(children, sep)
        if isinstance(schema, Schema):
            self.schema = schema.name
        elif schema is None:
            self.schema = None
        else:
            _check_name(schema, "schema")
            self.schema = schema
        where = "Prompt()" if self.schema is None else f"Prompt({self.schema!r})"
        _check_children(self.children, where, (str, Ref, Role), "text, ref() or a role")
        for r in self.children:
            if isinstance(r, Role):
                bad = [c for c in r.children if isinstance(c, (Module, Union))]
                if bad:
                    raise _module_in_prompt(bad[0], f"{r.role}() of {where}")
        refs = self.refs
        if refs and self.schema is None:
            raise _error(f"{_describe(refs[0])} in a prompt without a schema (name one to import modules)")
        _check_unique((r.name for r in refs), "import of module", f"the top level of {where}")
        if isinstance(schema, Schema):
            _Imports(schema).resolve(refs, schema.children, ())

    @property
    def refs(self) -> list[Ref]:
        """Top-level refs, those inside roles included, in order."""
        out = []
        for c in self.children:
            if isinstance(c, Ref):
                out.append(c)
            elif isinstance(c, Role):
                out += [r for r in c.children if isinstance(r, Ref)]
        return out

    def _attrs(self) -> dict:
        return {} if self.schema is None else {"schema": self.schema}

    def _start_safe(self) -> bool:
        return self.schema is None  # a prompt with a schema continues it: leading whitespace counts

    def __repr__(self) -> str:
        return f"Prompt({self.schema!r}, {len(self.children)} children)"


class _Imports:
    """Checks a prompt's refs against a builder schema (the rules of ``layout_prompt``)."""

    def __init__(self, schema: Schema):
        self.schema = schema
        self.union_choice: dict[int, str] = {}

    def resolve(self, refs: list[Ref], scope_children, path: tuple[str, ...]) -> None:
        scope = {m.name: (m, u) for m, u in _scope(scope_children)}
        for r in refs:
            if r.name not in scope:
                where = f"inside {'/'.join(path)!r}" if path else "at the top level"
                known = ", ".join(sorted(scope)) or "none"
                raise _error(f"unknown module {r.name!r} {where} of schema {self.schema.name!r} (known: {known})")
            m, u = scope[r.name]
            if u is not None:
                other = self.union_choice.setdefault(id(u), r.name)
                if other != r.name:
                    raise _error(f"two members of one union imported: {other!r} and {r.name!r} (a union allows one)")
            params = [p.name for p in m.children if isinstance(p, Param)]
            args = dict(r.args)
            unknown = [a for a in args if a not in params]
            if unknown:
                raise _error(
                    f"module {r.name!r} has no parameter {unknown[0]!r} (parameters: {', '.join(params) or 'none'})"
                )
            missing = [p for p in params if p not in args]
            if missing:
                raise _error(f"module {r.name!r} needs an argument for parameter(s): {', '.join(missing)}")
            self.resolve(list(r.children), m.children, path + (r.name,))


# ---------------------------------------------------------------------------------------------
# XML


def _build(parent, node) -> None:
    if isinstance(node, str):
        if not node:
            return
        if len(parent):
            parent[-1].tail = (parent[-1].tail or "") + node
        else:
            parent.text = (parent.text or "") + node
    elif isinstance(node, Param):
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
            _build(el, c)
    elif isinstance(node, Union):
        el = etree.SubElement(parent, "union", {} if node.scaffold is None else {"scaffold": node.scaffold})
        for m in node.members:
            _build(el, m)
    elif isinstance(node, Role):
        el = etree.SubElement(parent, node.role)
        for c in node.children:
            _build(el, c)
    elif isinstance(node, Ref):
        el = etree.SubElement(parent, node.name, dict(node.args))
        for c in node.children:
            _build(el, c)


_INDENT = "  "


def _pretty(el, depth: int, start_safe: bool, end_safe: bool) -> None:
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
            _pretty(k, depth + 1, start_safe=True, end_safe=True)
        elif k.tag == "module":
            _pretty(k, depth + 1, start_safe=False, end_safe=False)
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
        _pretty(m, depth + 1, start_safe=False, end_safe=False)
