"""Settings classes -> command-line options, environment variables and config-file keys.

Generic over any settings tree (``settings.leaves``: frozen dataclasses nesting dataclasses), so a
new field in any section gets its option, variable and key without an edit here; a field whose
type this file cannot parse fails at import (``TypeError``), not in a user's shell.

Names (a leaf's flat name, e.g. ``host_budget``): option ``--host-budget`` (a bool:
``--pin-memory/--no-pin-memory``; a tuple: repeatable), environment ``PROMPTCACHE_HOST_BUDGET``,
config-file key ``host_budget`` under its section's table (``[store]``; a root's own fields at
the root's table). ``--help`` lists the command's own options first, then one heading per
section (``SettingsCommand``).

Precedence, highest first: command line > environment > config file > the command's defaults >
the dataclass's defaults. A bad value is a ``ValueError`` that starts with where it came from
(``--recompute: ...``, ``environment PROMPTCACHE_RECOMPUTE: ...``, ``F.toml key store.host_budget:
...``). Config files: the flat layout before sections (every key at the top) is still read for
roots that had it, and warned about (``warning: ...`` on stderr: this is the front end).
"""

from __future__ import annotations

import dataclasses
import functools
import os
import re
import tomllib
from pathlib import Path

import click

from ..settings import Leaf, help_of, leaves, section_class, sections

__all__ = ["ENV_PREFIX", "SettingOption", "SettingsCommand", "env_name", "option_name", "parse_size",
           "parser", "read_toml", "settings_from", "settings_options"]

ENV_PREFIX = "PROMPTCACHE_"
OWN = "Options"  # the heading of a command's own (hand-written) options
_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9,
          "t": 10**12, "tb": 10**12, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def option_name(flat: str) -> str:
    return "--" + flat.replace("_", "-")


def env_name(flat: str) -> str:
    return ENV_PREFIX + flat.upper()


# -- parsing ------------------------------------------------------------------------------------
def parse_size(value: str | int | None) -> int | None:
    """Bytes from ``4GiB``, ``512MB``, ``1e9`` or an int; ``none``/empty means unbounded (None)."""
    if value is None or isinstance(value, int):
        return value
    text = str(value).strip().replace("_", "")
    if text.lower() in ("", "none", "unbounded"):
        return None
    m = re.fullmatch(r"([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([a-zA-Z]*)", text)
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"bad size {value!r}: expected a number with an optional unit (B, KB, MB, GB, KiB, MiB, GiB)")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def _parse_bool(value) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"bad boolean {value!r}: expected true/false, 1/0, yes/no or on/off")


def _is_none(value) -> bool:
    return value is None or (isinstance(value, str) and value.strip().lower() in ("", "none"))


def _parse_optional_str(value):
    return None if _is_none(value) else str(value)


def _parse_int(value) -> int:
    if isinstance(value, bool) or isinstance(value, float):  # a TOML 1.5 or true is not an integer
        raise ValueError(f"bad integer {value!r}")
    return int(value)


def _parse_optional_int(value):
    return None if _is_none(value) else _parse_int(value)


def _parse_float(value) -> float:
    if isinstance(value, bool):
        raise ValueError(f"bad number {value!r}")
    return float(value)


def _parse_float_or_word(value):
    if isinstance(value, (bool, int, float)):  # from a TOML file: the dataclass refuses a bool
        return value
    try:
        return float(value)
    except ValueError:
        return str(value).strip()


def _parse_list(value) -> tuple[str, ...]:
    """A tuple of strings: repeated options as given; a TOML list; text split at commas."""
    if isinstance(value, (list, tuple)):
        return tuple(str(v) for v in value)
    return tuple(p.strip() for p in str(value).split(",") if p.strip())


def _type_text(f: dataclasses.Field) -> str:
    t = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", str(f.type))
    return t.replace(" ", "")


_PARSERS = {"int": ("int", _parse_int), "int|None": ("int", _parse_optional_int), "float": ("float", _parse_float),
            "bool": ("bool", _parse_bool), "str": ("str", str), "str|None": ("str", _parse_optional_str),
            # a fraction or a word ("auto"): the dataclass checks which
            "float|str": ("value", _parse_float_or_word), "tuple[str,...]": ("list", _parse_list)}


def parser(leaf: Leaf):
    """(kind, parse) for a leaf from its annotation; ``*_budget`` / ``*_bytes`` ints are sizes."""
    t = _type_text(leaf.field)
    if t in ("int", "int|None") and leaf.field.name.endswith(("_budget", "_bytes")):
        return "size", parse_size
    if t not in _PARSERS:
        raise TypeError(f"{leaf.owner.__name__}.{leaf.field.name}: no command-line parser for type {leaf.field.type!r}; "
                        f"add one in {__name__}")
    return _PARSERS[t]


# -- options ------------------------------------------------------------------------------------
class SettingOption(click.Option):
    """An option generated from a settings leaf; ``heading``: its section's title in ``--help``."""

    def __init__(self, *args, heading: str = OWN, **kwargs):
        super().__init__(*args, **kwargs)
        self.heading = heading


class SettingsCommand(click.Command):
    """A command whose ``--help`` lists its own options, then a heading per settings section.
    Two options with one name are a ``TypeError`` when the command is built."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        names = [o for p in self.params for o in (*p.opts, *p.secondary_opts)]
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:
            raise TypeError(f"command {self.name!r}: options given twice: {', '.join(twice)}")

    def format_options(self, ctx, formatter):
        groups: dict[str, list] = {OWN: []}
        for p in self.get_params(ctx):
            record = p.get_help_record(ctx) if isinstance(p, click.Option) else None
            if record is not None:
                groups.setdefault(getattr(p, "heading", OWN), []).append(record)
        for heading, rows in groups.items():
            if rows:
                with formatter.section(heading):
                    formatter.write_dl(rows)


def _shown(value, kind: str) -> str:
    if value is None:
        return "unbounded"  # only sizes show a None default
    if kind == "size" and isinstance(value, int):
        for unit, n in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
            if value and value % n == 0:
                return f"{value // n}{unit}"
    if kind == "bool":
        return "on" if value else "off"
    return str(value)


def _help(leaf: Leaf, kind: str, default) -> str:
    text = help_of(leaf.field) or f"{leaf.owner.__name__}.{leaf.field.name}."
    shown = "" if default == () or (default is None and kind != "size") else f"default {_shown(default, kind)}; "
    return f"{text} [{shown}env {env_name(leaf.name)}]"


_METAVARS = {"str": "TEXT", "list": "TEXT"}


def _default(leaf: Leaf):
    f = leaf.field
    return f.default if f.default is not dataclasses.MISSING else None


def settings_options(root: type, into: str, *, skip=(), defaults: dict | None = None):
    """A decorator adding one option per leaf of ``root`` (less ``skip``: flat names set some other
    way); the values given on the command line reach the command as a dict ``{flat name: raw
    value}`` under ``into``. ``defaults``: the command's own defaults, shown in the help. Use with
    ``cls=SettingsCommand`` for headed help; a flat name another decorator already added is a
    TypeError."""
    chosen = [leaf for leaf in leaves(root) if leaf.name not in skip]
    kinds = {leaf.name: parser(leaf)[0] for leaf in chosen}  # at import: an unparsable type fails now
    titles = {s.path: s.title for s in sections(root)}

    def decorate(f):
        taken = set(getattr(f, "__settings__", ()))
        clash = taken & set(kinds)
        if clash:
            raise TypeError(f"{root.__name__}: options {', '.join(sorted(clash))} are added twice")

        @functools.wraps(f)
        def wrapper(*args, **kwargs):
            given = {name: kwargs.pop(name) for name in kinds}
            kwargs[into] = {k: v for k, v in given.items() if v is not None and v != ()}
            return f(*args, **kwargs)

        for leaf in reversed(chosen):
            kind = kinds[leaf.name]
            default = (defaults or {}).get(leaf.name, _default(leaf))
            extra = {} if kind == "bool" else {"metavar": _METAVARS.get(kind, kind.upper()), "multiple": kind == "list"}
            decl = f"{option_name(leaf.name)}/--no-{leaf.name.replace('_', '-')}" if kind == "bool" \
                else option_name(leaf.name)
            wrapper = click.option(decl, leaf.name, cls=SettingOption, heading=titles[leaf.section], default=None,
                                   help=_help(leaf, kind, default), **extra)(wrapper)
        wrapper.__settings__ = taken | set(kinds)
        return wrapper

    return decorate


# -- values -------------------------------------------------------------------------------------
def read_toml(path: str | Path) -> dict:
    try:
        return tomllib.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, tomllib.TOMLDecodeError) as e:
        raise ValueError(f"--config {path}: {e}") from None


def _file_values(root: type, table: dict, where: str, *, ignore=()):
    """{flat name: (value, source)} from a config file's table for ``root``: each leaf in its
    section's table (``[store] host_budget``). A leaf at the top by its flat name is an unknown key
    whose message names its place."""
    every = leaves(root)
    by_path, by_flat = {leaf.path: leaf for leaf in every}, {leaf.name: leaf for leaf in every}
    section_paths = {s.path for s in sections(root)}
    values: dict[str, tuple] = {}
    unknown = []

    def visit(tab, path):
        for key, v in tab.items():
            p = path + (key,)
            if p in section_paths and isinstance(v, dict):
                visit(v, p)
            elif p in by_path and not isinstance(v, dict):
                values[by_path[p].name] = (v, f"{where} key {'.'.join(p)}")
            elif not path and key in by_flat and by_flat[key].section:
                leaf = by_flat[key]
                unknown.append(f"{key} (its place: [{'.'.join(leaf.section)}] {leaf.field.name})")
            elif path or key not in ignore:
                unknown.append(".".join(p))

    visit(table, ())
    if unknown:
        known = sorted({".".join(leaf.path) for leaf in every})
        raise ValueError(f"{where}: unknown keys {', '.join(unknown)} (known: {', '.join(known)})")
    return values


def _blame(e: Exception, cls: type, path: tuple, given: dict) -> str:
    """The dataclass's error, prefixed with where the value it names came from."""
    text = str(e)
    mine = {p: src for p, src in given.items() if p[:-1] == path}
    for p, src in mine.items():
        f = next(fl for fl in dataclasses.fields(cls) if fl.name == p[-1])
        if re.search(rf"\b({re.escape(f.name)}|{re.escape(f.metadata.get('flat', f.name))})\b", text):
            return f"{src}: {text}"
    return f"{next(iter(mine.values()))}: {text}" if len(mine) == 1 else text


def _build(cls: type, path: tuple, parsed: dict, sources: dict):
    kwargs = {}
    for f in dataclasses.fields(cls):
        sub = section_class(f)
        if sub is not None:
            kwargs[f.name] = _build(sub, path + (f.name,), parsed, sources)
        elif path + (f.name,) in parsed:
            kwargs[f.name] = parsed[path + (f.name,)]
    try:
        return cls(**kwargs)
    except (TypeError, ValueError) as e:
        raise ValueError(_blame(e, cls, path, sources)) from None


def settings_from(root: type, given: dict, config_file: str | Path | None = None, env=None, *,
                  defaults: dict | None = None, skip=(), table_path: tuple[str, ...] = (), ignore=(),
                  fixed: dict | None = None):
    """A ``root`` instance from the command line's ``given`` values > ``env`` > the config file's
    table at ``table_path`` > ``defaults`` > the dataclass's defaults. ``ignore``: other roots'
    tables at the file's top; ``fixed``: {flat name: parsed value} set by other options (``--device``)."""
    env = os.environ if env is None else env
    every = {leaf.name: leaf for leaf in leaves(root) if leaf.name not in skip}
    values: dict[str, tuple] = {k: (v, "command default") for k, v in (defaults or {}).items()}
    if config_file is not None:
        data = read_toml(config_file)
        for depth, key in enumerate(table_path):
            data = data.get(key, {})
            if not isinstance(data, dict):
                raise ValueError(f"{config_file}: {'.'.join(table_path[:depth + 1])} must be a table ([...]), "
                                 f"got {data!r}")
        found = _file_values(root, data, str(config_file), ignore=ignore)
        values.update({k: v for k, v in found.items() if k in every})
        skipped = sorted(set(found) - set(every))
        if skipped:
            raise ValueError(f"{config_file}: keys {', '.join(skipped)} are set by options, not by this file")
    values.update({name: (env[env_name(name)], f"environment {env_name(name)}") for name in every
                   if env_name(name) in env})
    values.update({name: (v, option_name(name)) for name, v in given.items()})
    parsed, sources = {}, {}
    for name, (v, where) in values.items():
        try:
            parsed[every[name].path] = parser(every[name])[1](v)
        except (TypeError, ValueError) as e:
            raise ValueError(f"{where}: {e}") from None
        sources[every[name].path] = where
    for name, v in (fixed or {}).items():
        parsed[leaves_by_name(root)[name].path] = v
    return _build(root, (), parsed, sources)


def leaves_by_name(root: type) -> dict[str, Leaf]:
    return {leaf.name: leaf for leaf in leaves(root)}
