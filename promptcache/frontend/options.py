"""Options shared by the commands: the model group and the ``EngineConfig`` group.

The ``EngineConfig`` options are generated from its sections (``walker.py``): one option per
leaf of ``RunnerConfig``, ``StoreConfig``, ``RecomputeConfig`` and ``EngineConfig.namespace``,
under a ``--help`` heading per section, with the flat names they always had (``--host-budget``,
``--recompute``, ``--packed-linear``). ``device`` is the one leaf left out: ``--device`` of the
model group sets it.

Precedence, highest first: command line > environment (``PROMPTCACHE_<FIELD>``, e.g.
``PROMPTCACHE_HOST_BUDGET=4GiB``) > config file (``--config F.toml``: ``namespace`` at the top,
the rest in ``[runner]``, ``[store]``, ``[recompute]``; ``[server]`` is ``serve``'s) > the
dataclass's defaults. A key out of its section's table is refused with its place.
"""

from __future__ import annotations

from pathlib import Path

import click

from ..engine.prefill.config import EngineConfig
from ..settings import leaves
from .walker import ENV_PREFIX, env_name, option_name, parse_size, parser, settings_from, settings_options

__all__ = ["CONFIG_HELP", "DTYPES", "ENV_PREFIX", "FIELDS", "engine_config", "engine_options", "env_name",
           "model_options", "option_name", "parse_size"]

DTYPES = ("auto", "float32", "bfloat16", "float16")
SKIPPED = {"device"}  # set by --device (model options)
OTHER_TABLES = ("server",)  # tables of the same file that other settings own (serve's ServerConfig)
# flat name -> (kind, parse) of every EngineConfig option
FIELDS = {leaf.name: parser(leaf) for leaf in leaves(EngineConfig) if leaf.name not in SKIPPED}
CONFIG_HELP = ("TOML file of settings: namespace at the top; [runner], [store], [recompute] (and serve's [server]) "
               "hold their fields. Precedence: command line > PROMPTCACHE_* environment > this file > defaults.")


def engine_options(f=None, *, defaults: dict | None = None):
    """Decorate a command with one option per EngineConfig leaf plus ``--config F.toml``; the
    values reach the command as ``engine`` (a dict of the options given) and ``config_file``.
    ``defaults``: the command's own defaults (``serve``'s budgets), shown in the help; pass the
    same to ``engine_config``. Usable bare (``@engine_options``) or called."""

    def decorate(f):
        f = settings_options(EngineConfig, "engine", skip=SKIPPED, defaults=defaults)(f)
        return click.option("--config", "config_file", type=click.Path(exists=True, dir_okay=False), default=None,
                            help=CONFIG_HELP)(f)

    return decorate(f) if f is not None else decorate


def engine_config(cli_values: dict, config_file: str | Path | None = None, env=None,
                  device: str | None = None, defaults: dict | None = None) -> EngineConfig:
    """The EngineConfig from defaults (the dataclass's, then ``defaults``) < config file <
    environment < command line. A bad value is a ValueError naming where it came from."""
    return settings_from(EngineConfig, cli_values, config_file, env, defaults=defaults, skip=SKIPPED,
                         ignore=OTHER_TABLES,
                         fixed={"device": device} if device is not None else None)


def model_options(f):
    """--model, --device, --dtype (a click.Choice: typos are refused before anything loads)."""
    f = click.option("--dtype", default="auto", show_default=True, type=click.Choice(DTYPES),
                     help="auto: the checkpoint's dtype where the device computes it natively (bfloat16 on a "
                          "CPU with bfloat16 instructions), else float32; a float32 checkpoint runs in bfloat16 "
                          "on CUDA.")(f)
    f = click.option("--device", default=None, help="cpu, cuda, cuda:1 ... (default: cuda when available).")(f)
    f = click.option("--model", "-m", default="embedded", show_default=True,
                     help="Hugging Face model id, local directory, 'smollm2' (SmolLM2-135M-Instruct, fetched "
                          "once), 'gemma3-270m' (Gemma 3 270M base, fetched once), or 'embedded' / "
                          "'embedded:bench' (random weights from shipped configs, no download).")(f)
    return f
