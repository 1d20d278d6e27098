"""Options shared by the commands: the model group and the ``EngineConfig`` group.

The ``EngineConfig`` options are generated from the dataclass's fields, so a new field gets an
option (and an environment variable, and a config-file key) without touching this file; a field
whose type this file cannot parse fails at import, not silently. ``device`` is the one field
left out: ``--device`` of the model group sets it.

Precedence, highest first: command line > environment (``PROMPTCACHE_<FIELD>``, e.g.
``PROMPTCACHE_HOST_BUDGET=4GiB``) > config file (``--config F.toml``: keys are field names, at
the top level or under ``[engine]``) > the dataclass's defaults.
"""

from __future__ import annotations

import dataclasses
import os
import re
import tomllib
from pathlib import Path

import click

from ..engine.config import EngineConfig

__all__ = ["DTYPES", "ENV_PREFIX", "FIELDS", "engine_config", "engine_options", "model_options", "parse_size"]

ENV_PREFIX = "PROMPTCACHE_"
DTYPES = ("auto", "float32", "bfloat16", "float16")
SKIPPED = {"device"}  # set by --device (model options)
_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9,
          "t": 10**12, "tb": 10**12, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
_HELP = {
    "encode_chunk": "Tokens per forward while encoding a schema.",
    "encode_batch_bytes": "KV bytes a batched encoding forward may allocate (size: 256MiB).",
    "device_budget": "Device memory for stored states (size: 4GiB; default unbounded).",
    "host_budget": "Host memory for stored states (size: 4GiB; default unbounded).",
    "spill_dir": "Folder for evicted states that have no artifact (default: a temp folder). A folder named "
                 "here persists: a restart on it serves its states again.",
    "disk_budget": "Disk for spill files in --spill-dir (size: 20GiB; default unbounded); least recently used deleted.",
    "disk_policy": "on_evict: states reach --spill-dir when memory evicts them (and at shutdown); through: at once.",
    "pin_memory": "Pin host copies of states for fast device copies.",
    "overlap_copies": "On a GPU, copy host-held states in layer groups beside the forward (helps GPU-bound forwards).",
    "namespace": "Cache namespace: states are never shared across namespaces.",
    "kv_dtype": "dtype of stored module states (default: the model's).",
    "recompute": "Drifted cached tokens computed afresh per prompt: auto (exact prompts none, drifted ones a "
                 "measured budget) or a fraction in [0, 1] (0: the paper's splice).",
    "remote": "Shared tier below disk: redis://[:password@]host:port/db.",
    "compile": "Compile serving steps of few tokens (decode, short prefills) with torch.compile, padded to "
               "buckets; CUDA graphs on a GPU. Each bucket compiles once on first use (kept on disk).",
    "packed_linear": "CPU, float32: run every linear layer through oneDNN with its weight packed once (about "
                     "2x faster decode on SmolLM2; within float32 rounding of the stock forward; one more copy "
                     "of the linear weights in memory).",
}


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


def _parse_optional_str(value):
    return None if value is None or str(value).strip().lower() in ("", "none") else str(value)


def _parse_float_or_word(value):
    if isinstance(value, (bool, int, float)):  # from a TOML file: the dataclass refuses a bool
        return value
    try:
        return float(value)
    except ValueError:
        return str(value).strip()


def _parser(f: dataclasses.Field):
    """(kind, parse) for a field from its annotation (a string: the module uses postponed annotations)."""
    t = str(f.type).replace(" ", "")
    if t in ("int", "int|None") and f.name.endswith(("_budget", "_bytes")):
        return "size", parse_size
    if t == "int":
        return "int", int
    if t == "float":
        return "float", float
    if t == "bool":
        return "bool", _parse_bool
    if t == "str":
        return "str", str
    if t == "str|None":
        return "str", _parse_optional_str
    if t == "float|str":  # a fraction or a word ("auto"): the dataclass checks which
        return "value", _parse_float_or_word
    raise TypeError(f"EngineConfig.{f.name}: no command-line parser for type {f.type!r}; add one in {__name__}")


FIELDS = {f.name: _parser(f) for f in dataclasses.fields(EngineConfig) if f.name not in SKIPPED}


def option_name(field: str) -> str:
    return "--" + field.replace("_", "-")


def env_name(field: str) -> str:
    return ENV_PREFIX + field.upper()


def engine_options(f):
    """Decorate a command with one option per EngineConfig field plus ``--config F.toml``; the
    values reach the command as ``engine`` (a dict of the options given) and ``config_file``."""
    for name, (kind, _) in reversed(list(FIELDS.items())):
        help_ = f"{_HELP.get(name, 'EngineConfig.' + name)} [env {env_name(name)}]"
        if kind == "bool":
            decl = f"{option_name(name)}/--no-{name.replace('_', '-')}"
            f = click.option(decl, name, default=None, help=help_)(f)
        else:
            f = click.option(option_name(name), name, default=None, metavar=kind.upper(), help=help_)(f)
    f = click.option("--config", "config_file", type=click.Path(exists=True, dir_okay=False), default=None,
                     help="TOML file of engine settings (EngineConfig field names; top level or [engine]). "
                          "Precedence: command line > PROMPTCACHE_* environment > this file > defaults.")(f)
    return _collect(f)


def _collect(f):
    import functools

    @functools.wraps(f)
    def wrapper(*args, **kwargs):
        engine = {name: kwargs.pop(name) for name in FIELDS if name in kwargs}
        return f(*args, engine={k: v for k, v in engine.items() if v is not None}, **kwargs)

    return wrapper


def engine_config(cli_values: dict, config_file: str | Path | None = None, env=None,
                  device: str | None = None, defaults: dict | None = None) -> EngineConfig:
    """The EngineConfig from defaults (the dataclass's, then ``defaults``) < config file <
    environment < command line. A bad value is a ValueError naming where it came from."""
    env = os.environ if env is None else env
    values: dict = {k: (v, "command default") for k, v in (defaults or {}).items()}
    if config_file is not None:
        try:
            data = tomllib.loads(Path(config_file).read_text(encoding="utf-8"))
        except (OSError, tomllib.TOMLDecodeError) as e:
            raise ValueError(f"--config {config_file}: {e}") from None
        table = data.get("engine", data)
        unknown = sorted(set(table) - set(FIELDS) - {"engine"})
        if unknown:
            raise ValueError(f"--config {config_file}: unknown keys {', '.join(unknown)} (known: {', '.join(FIELDS)})")
        values.update({k: (v, f"{config_file} key {k}") for k, v in table.items() if k in FIELDS})
    for name in FIELDS:
        if env_name(name) in env:
            values[name] = (env[env_name(name)], f"environment {env_name(name)}")
    for name, v in cli_values.items():
        values[name] = (v, option_name(name))
    parsed = {}
    for name, (v, where) in values.items():
        try:
            parsed[name] = FIELDS[name][1](v)
        except (TypeError, ValueError) as e:
            raise ValueError(f"{where}: {e}") from None
    if device is not None:
        parsed["device"] = device
    try:
        return EngineConfig(**parsed)
    except ValueError as e:  # the dataclass's own checks: say where the offending value came from
        bad = [n for n in values if f"EngineConfig.{n}" in str(e) or (n == "namespace" and "namespace" in str(e))]
        raise ValueError(f"{values[bad[0]][1]}: {e}" if bad else str(e)) from None


def model_options(f):
    """--model, --device, --dtype (a click.Choice: typos are refused before anything loads)."""
    f = click.option("--dtype", default="auto", show_default=True, type=click.Choice(DTYPES),
                     help="auto: float32 on CPU, bfloat16 on CUDA.")(f)
    f = click.option("--device", default=None, help="cpu, cuda, cuda:1 ... (default: cuda when available).")(f)
    f = click.option("--model", "-m", default="embedded", show_default=True,
                     help="Hugging Face model id, local directory, 'smollm2' (SmolLM2-135M-Instruct, fetched "
                          "once), or 'embedded' / 'embedded:bench' (random weights from shipped configs, "
                          "no download).")(f)
    return f
