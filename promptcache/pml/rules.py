"""The PML rules, written once: names, scopes, parameters, roles, emptiness and imports.

The parser (PML text), the layout (prompts against a schema) and the builder (PML from Python)
all check trees of ``pml.nodes`` with these functions, so a rule and its error message exist in
one place. Each function raises ``PMLError(reason, source, line)``; nodes made by the builder
have ``line=None``, so their errors name only the source (``<builder>``).
"""

from __future__ import annotations

import re
from typing import Iterable, Iterator

from .errors import PMLError, raise_collected
from .nodes import ROLES, Module, ModuleRef, Parameter, Role, Text, Union

NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_.-]*$")
MAX_PARAMETER_LENGTH = 1 << 20  # positions; a larger slot is a typo, not a prompt
RESERVED = frozenset({"schema", "prompt", "module", "union", "parameter", *ROLES})

Path_ = tuple[str, ...]  # a module's path: names from the schema root


def check_name(name: str, what: str, source: str, line: int | None) -> None:
    """An XML name; module (and ref) names must not be a PML tag."""
    if not NAME.match(name):
        raise PMLError(f"{what} name '{name}' is not a valid XML name ([A-Za-z_][A-Za-z0-9_.-]*)", source, line)
    if what in ("module", "ref") and name in RESERVED:
        raise PMLError(f"{what} name '{name}' is reserved (it is a PML tag)", source, line)


def length_ok(n) -> bool:
    """A parameter length: an int in [1, MAX_PARAMETER_LENGTH] (bools are not lengths)."""
    return isinstance(n, int) and not isinstance(n, bool) and 1 <= n <= MAX_PARAMETER_LENGTH


def check_union(u: Union, source: str) -> None:
    """A union has modules only (at least one), and its scaffold names one of them."""
    if not u.members:
        raise PMLError("<union> has no <module> members", source, u.line)
    names = [m.name for m in u.members]
    if u.scaffold is not None and u.scaffold not in names:
        raise PMLError(f"union scaffold '{u.scaffold}' is not one of its members ({', '.join(names)})", source, u.line)


def scope(children: Iterable) -> Iterator[tuple[Module, Union | None]]:
    """Modules of one scope with the union holding each: union members count in the scope that
    holds the union; roles open no scope."""
    for c in children:
        if isinstance(c, Module):
            yield c, None
        elif isinstance(c, Union):
            for m in c.members:
                yield m, c
        elif isinstance(c, Role):
            yield from scope(c.children)


def check_scope_names(children: list, source: str, recurse: bool = True) -> None:
    """Module names are unique per scope (union members included); parameters unique per module."""
    seen: dict[str, int | None] = {}
    for m, _ in scope(children):
        if m.name in seen:
            first = f" (first at line {seen[m.name]})" if seen[m.name] is not None else ""
            raise PMLError(f"duplicate module name '{m.name}' in one scope{first}", source, m.line)
        seen[m.name] = m.line
        if recurse:
            check_scope_names(m.children, source)
    params: dict[str, int | None] = {}
    for p in children:
        if isinstance(p, Parameter):
            if p.name in params:
                first = f" (first at line {params[p.name]})" if params[p.name] is not None else ""
                raise PMLError(f"duplicate parameter name '{p.name}' in one module{first}", source, p.line)
            params[p.name] = p.line


def check_roles_only(children: list, source: str) -> None:
    """A schema that uses roles holds nothing but roles (and whitespace) at its top level."""
    if any(isinstance(c, Role) for c in children):
        for c in children:
            if not isinstance(c, Role) and not (isinstance(c, Text) and not c.text.strip()):
                raise PMLError(
                    "content outside a role in a schema that uses roles (<system>/<user>/<assistant>)",
                    source,
                    c.line,
                )


def check_not_empty(name: str, children: list, source: str, line: int | None) -> None:
    """A schema holds some text, a module or a role: an empty schema is an error."""
    if not any(not isinstance(c, Text) or c.text.strip() for c in children):
        raise PMLError(f"schema '{name}' is empty: it holds no text and no module", source, line)


def check_imported_once(refs: list[ModuleRef], source: str, path: Path_ = ()) -> None:
    """No module is referenced twice in one scope of a prompt."""
    raise_collected(_imported_twice(refs, source, path))


def _imported_twice(refs: list[ModuleRef], source: str, path: Path_) -> list[PMLError]:
    seen: set[str] = set()
    errors = []
    for ref in refs:
        if ref.name in seen:
            errors.append(PMLError(f"module '{'/'.join(path + (ref.name,))}' imported twice", source, ref.line))
        seen.add(ref.name)
    return errors


def resolve_imports(refs: list[ModuleRef], schema_name: str, children: list, source: str,
                    errors: list[PMLError] | None = None) -> dict[Path_, ModuleRef]:
    """Check a prompt's module references against a schema tree: every module exists in the scope
    it is named in, is imported once, at most one member per union, every parameter gets an
    argument and no unknown argument is given. Returns path -> reference, in import order.
    Every error is found: raised together (``PMLErrors``), or, where ``errors`` is given, appended
    to it and the bad references left out of what is returned (the caller raises them later)."""
    imported: dict[Path_, ModuleRef] = {}
    chosen: dict[int, str] = {}  # id(union) -> imported member
    found: list[PMLError] = []

    def check(ref: ModuleRef, members: dict, path: Path_) -> str | None:
        """Why ``ref`` cannot be imported (None: it can)."""
        if ref.name not in members:
            where = f"inside '{'/'.join(path)}'" if path else "at the top level"
            known = ", ".join(sorted(members)) or "none"
            return f"unknown module '{ref.name}' {where} of schema '{schema_name}' (known: {known})"
        m, u = members[ref.name]
        if u is not None:
            other = chosen.setdefault(id(u), ref.name)
            if other != ref.name:
                return f"two members of one union imported: '{other}' and '{ref.name}' (a union allows one)"
        params = [c.name for c in m.children if isinstance(c, Parameter)]
        unknown = [a for a in ref.args if a not in params]
        if unknown:
            return f"module '{ref.name}' has no parameter '{unknown[0]}' (parameters: {', '.join(params) or 'none'})"
        missing = [n for n in params if n not in ref.args]
        if missing:
            return f"module '{ref.name}' needs an argument for parameter(s): {', '.join(missing)}"
        return None

    def walk(refs: list[ModuleRef], scope_children: list, path: Path_) -> None:
        members = {m.name: (m, u) for m, u in scope(scope_children)}
        found.extend(_imported_twice(refs, source, path))
        for ref in refs:
            why = check(ref, members, path)
            if why is not None:
                found.append(PMLError(why, source, ref.line))
                continue
            imported[path + (ref.name,)] = ref
            walk(ref.children, members[ref.name][0].children, path + (ref.name,))

    walk(refs, children, ())
    if errors is None:
        raise_collected(found)
    else:
        errors.extend(found)
    return imported
