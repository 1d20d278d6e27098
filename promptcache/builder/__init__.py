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
exactly the caller's text (indentation rule aside); both parse to the same tree
(tests/pml/test_builder.py checks this on random trees). Escaping is lxml's: ``&``, ``<``,
quotes and newlines, tabs and carriage returns in attribute values all survive a round trip.

**Nodes.** The lowercase functions return ``pml.nodes`` objects (``Parameter``, ``Module``,
``Union``, ``Role``, ``ModuleRef``; text as ``Text``), the parser's own node classes, with
``line=None``; the builder never changes a node after making it. ``Schema.tree()`` and
``Prompt.tree()`` give the normalized trees the parser would give for ``to_pml()`` (they can go
straight to ``layout_schema``/``layout_prompt``); a schema with ``src=`` modules has no tree
until it is saved (the file is read relative to the saved schema: parse that file).

**Indentation.** A text whose first line is indented and which has more lines is written with
a newline before it, so the parser removes the indentation common to all its lines and code
keeps its relative indentation (without it, the first line's indentation would be a mere
separator). Indentation of the first line beyond what the other lines share cannot survive
PML's whitespace rule.

**Validation.** Every constructor checks its arguments at once and raises ``PMLError`` (a
``ValueError``) saying what is wrong. Argument types and where a node may go (a parameter
outside a module, a role below the top level, refs in schemas or modules and modules in
prompts, text inside a ref or a union, characters XML cannot hold) are the builder's own
checks; the language rules are the parser's and layout's, from ``pml/rules.py``: names,
reserved names, parameter lengths, duplicate names in a scope, unions, roles-only schemas,
empty schemas, a module imported twice and, for a ``Prompt`` given a builder ``Schema``, the
import rules (unknown modules, missing or unknown arguments, two members of one union).
"""


from __future__ import annotations

import os

from ..pml.nodes import ModuleRef, Parameter, Role, Text
from ..pml.nodes import Module as Module
from ..pml.nodes import Union as Union
from ..pml.rules import check_imported_once, check_name, check_scope_names, check_union, length_ok
from ..pml.rules import MAX_PARAMETER_LENGTH
from .check import SOURCE, check_children, check_chars, check_type_name, error, join, texts
from .document import Prompt, Schema

Param, Ref = Parameter, ModuleRef  # the builder's names for these node classes

__all__ = [
    "Module", "Param", "Prompt", "Ref", "Role", "Schema", "Union",
    "assistant", "module", "param", "ref", "system", "union", "user",
]


def param(name: str, length: int, scaffold: str = "") -> Parameter:
    """A parameter slot of ``length`` positions; ``scaffold`` fills it while encoding."""
    check_type_name(name, "parameter")
    if not length_ok(length):
        raise error(f"param({name!r}) has length {length!r}: expected a positive int (at most {MAX_PARAMETER_LENGTH})")
    if not isinstance(scaffold, str):
        raise error(f"param({name!r}) scaffold must be a string, got {type(scaffold).__name__}")
    check_chars(scaffold, f"param({name!r}) scaffold")
    return Parameter(name, length, scaffold, None)


def module(name: str, /, *children, cache: bool = True, src: str | os.PathLike | None = None, sep: str = "") -> Module:
    """A module. ``cache=False``: never stored. ``src``: text from a file relative to the schema file."""
    check_type_name(name, "module")
    where = f"module({name!r})"
    if not isinstance(cache, bool):
        raise error(f"{where} cache must be True or False, got {cache!r}")
    children = join(children, sep)
    if src is not None:
        src = os.fspath(src) if isinstance(src, os.PathLike) else src
        if not isinstance(src, str) or not src:
            raise error(f"{where} src must be a non-empty path, got {src!r}")
        check_chars(src, f"{where} src")
        if children:
            raise error(f"{where} has both src= and content (its text comes from the file)")
    check_children(children, where, (str, Parameter, Module, Union), "text, param(), module() or union()")
    nodes = texts(children)
    check_scope_names(nodes, SOURCE, recurse=False)  # nested modules were checked when made
    return Module(name, nodes, None, cache=cache, src=src)


def union(*members: Module, scaffold: str | None = None) -> Union:
    """Alternatives sharing positions; ``scaffold`` names the member standing in while encoding."""
    check_children(
        members, "union()", (Module,), "module()",
        "a union holds only modules (put text in a member, or around the union)",
    )
    u = Union(list(members), None, scaffold)
    check_union(u, SOURCE)
    check_scope_names([u], SOURCE, recurse=False)
    return u


def _role(role: str, children: tuple, sep: str) -> Role:
    children = join(children, sep)
    where = f"{role}()"
    check_children(children, where, (str, Module, Union, ModuleRef), "text, module(), union() or ref()")
    kinds = {type(c) for c in children} & {Module, Union, ModuleRef}
    if ModuleRef in kinds and len(kinds) > 1:
        raise error(f"{where} mixes schema content (module/union) with prompt content (ref)")
    nodes = texts(children)
    check_scope_names(nodes, SOURCE, recurse=False)
    check_imported_once([c for c in nodes if isinstance(c, ModuleRef)], SOURCE)
    return Role(role, nodes, None)


def system(*children, sep: str = "") -> Role:
    return _role("system", children, sep)


def user(*children, sep: str = "") -> Role:
    return _role("user", children, sep)


def assistant(*children, sep: str = "") -> Role:
    return _role("assistant", children, sep)


def ref(name: str, /, *children: ModuleRef, **args: str) -> ModuleRef:
    """Import module ``name`` in a prompt; keyword arguments fill its parameters, positional
    refs import its nested modules: ``ref("plan", ref("detail"), days="3")``."""
    check_type_name(name, "ref")
    where = f"ref({name!r})"
    for k, v in args.items():
        check_name(k, f"{where} argument", SOURCE, None)
        if not isinstance(v, str):
            raise error(f"argument {k!r} of {where} must be a string, got {type(v).__name__} {v!r}")
        check_chars(v, f"argument {k!r} of {where}")
    check_children(children, where, (ModuleRef,), "ref()", "a ref holds only nested refs (free text goes between refs)")
    check_imported_once(list(children), SOURCE, (name,))
    return ModuleRef(name, dict(args), list(children), None)
