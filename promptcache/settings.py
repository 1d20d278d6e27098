"""Settings dataclasses: a field carries its own help, and ``leaves`` walks nested settings.

A settings class (``EngineConfig``, ``StoreConfig``, ``ServerConfig`` ...) is a frozen dataclass
whose fields are values or other settings classes (a field whose ``default_factory`` is a
dataclass is a nested section). The command line, the environment and config files are generated
from this shape by ``frontend/options.py``; this module holds the part that needs no click, so
the library (``EngineConfig`` names the section of a misplaced keyword) and the front ends walk the same tree.

Decisions:
- A leaf's *flat name* is its field name, or ``metadata["flat"]`` where the field's name would
  read badly without its section (``RecomputeConfig.fraction`` is ``recompute``). Option
  ``--flat-name``, environment ``PROMPTCACHE_FLAT_NAME``.
- Flat names are unique under a root: ``leaves`` raises ``TypeError`` otherwise, and it runs at
  import of every module that generates options, so a clash fails at once, not in a user's shell.
- Help sits beside the field (``setting(default, "help")``), never in a table elsewhere; a
  section's title is its field's help (``nested(cls, "Store (EngineConfig.store)")``), a root's
  its class attribute ``TITLE`` (not a field: no annotation).
"""

from __future__ import annotations

import dataclasses
from dataclasses import MISSING, dataclass

__all__ = ["Leaf", "Section", "flat_name", "help_of", "leaves", "nested", "sections", "setting"]

HELP = "help"
FLAT = "flat"


def setting(default=MISSING, help: str = "", *, flat: str | None = None, default_factory=MISSING):
    """A dataclass field with its help text (and its flat name when not the field's name)."""
    metadata = {HELP: help, **({FLAT: flat} if flat else {})}
    return dataclasses.field(default=default, default_factory=default_factory, metadata=metadata)


def nested(cls: type, help: str = ""):
    """A field holding a settings section: ``cls()`` by default; ``help`` heads its options."""
    return dataclasses.field(default_factory=cls, metadata={HELP: help})


def flat_name(f: dataclasses.Field) -> str:
    return f.metadata.get(FLAT, f.name)


def help_of(f: dataclasses.Field) -> str:
    return f.metadata.get(HELP, "")


def section_class(f: dataclasses.Field) -> type | None:
    """The settings class a field nests, or None for a value field."""
    factory = f.default_factory
    return factory if isinstance(factory, type) and dataclasses.is_dataclass(factory) else None


@dataclass(frozen=True)
class Leaf:
    """One value setting: ``path`` the field names from the root down to it."""

    path: tuple[str, ...]  # ("store", "host_budget"); a root's own field: ("namespace",)
    field: dataclasses.Field
    owner: type  # the settings class that declares the field

    @property
    def name(self) -> str:  # the flat name: option, environment variable
        return flat_name(self.field)

    @property
    def section(self) -> tuple[str, ...]:
        return self.path[:-1]


@dataclass(frozen=True)
class Section:
    """A settings class in the tree: ``path`` () for the root; ``title`` its field's help."""

    path: tuple[str, ...]
    cls: type
    title: str


def sections(root: type, path: tuple[str, ...] = (), title: str = "") -> list[Section]:
    """The root and every nested section, depth first, in field order."""
    out = [Section(path, root, title or getattr(root, "TITLE", root.__name__))]
    for f in dataclasses.fields(root):
        sub = section_class(f)
        if sub is not None:
            out += sections(sub, path + (f.name,), help_of(f) or sub.__name__)
    return out


def leaves(root: type) -> list[Leaf]:
    """Every value field under ``root``, in field order (a section's leaves where the section
    stands). ``TypeError`` when two share a flat name: options and variables would then set
    either one."""
    out = [Leaf(s.path + (f.name,), f, s.cls) for s in sections(root)
           for f in dataclasses.fields(s.cls) if section_class(f) is None]
    seen: dict[str, Leaf] = {}
    for leaf in out:
        if leaf.name in seen:
            raise TypeError(f"{root.__name__}: the flat name {leaf.name!r} is used by both "
                            f"{'.'.join(seen[leaf.name].path)} and {'.'.join(leaf.path)}; flat names must be unique")
        seen[leaf.name] = leaf
    return out
