"""The ``promptcache`` command line: one click group; the commands live beside it.

``commands.py`` (run, compile, inspect, validate, bench), ``demo.py``, ``chat.py``. What they
share with the server's ``serve`` (option groups, error mapping, engine loading) is
``promptcache.frontend``. ``serve`` lives in ``promptcache.server.cli`` (the server runs on its
own as ``python -m promptcache.server``) and is resolved when asked for, as is ``studio``
(``promptcache.server.studio_cli``), so ``promptcache --help``
never imports the server's optional dependencies.

Layering: ``cli`` is the top of the package: it imports ``server`` (for ``serve``), nothing imports
it; ``server`` and ``cli`` both stand on ``frontend``.
"""

from __future__ import annotations

import click

from .chat import chat
from .commands import bench, compile, inspect, run, validate
from .demo import demo
from .vllm_config import vllm_config

__all__ = ["main"]


# the lines of the commands that live in the server in `promptcache --help`, so that listing the
# commands imports neither the server nor torch
SUMMARIES = {"serve": "Serve OpenAI- and Anthropic-compatible HTTP APIs (the serve extra).",
             "studio": "Open the studio web page on a local model: schema layout, prompt spans, cache (serve extra)."}


class _Main(click.Group):
    """The command group; ``serve`` and ``studio`` (with their optional dependencies) are imported on demand."""

    def list_commands(self, ctx):
        return sorted(set(super().list_commands(ctx)) | set(SUMMARIES))

    def format_commands(self, ctx, formatter):
        names = self.list_commands(ctx)
        limit = formatter.width - 6 - max(map(len, names))
        rows = [(n, SUMMARIES[n] if n in SUMMARIES else self.commands[n].get_short_help_str(limit)) for n in names]
        with formatter.section("Commands"):
            formatter.write_dl(rows)

    def get_command(self, ctx, name):
        if name == "serve":
            from ..server.cli import serve

            return serve
        if name == "studio":  # the server's app on a local model (server/studio_cli.py)
            from ..server.studio_cli import studio

            return studio
        return super().get_command(ctx, name)


@click.group(cls=_Main, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="promptcache")
def main():
    """Prompt Cache: reuse the attention states of prompt modules for fast time to first token.

    \b
    Quick tour (no network needed; SCHEMA.xml is a schema file, PROMPT.xml a prompt using it):
      promptcache demo
      promptcache inspect SCHEMA.xml PROMPT.xml
      promptcache compile SCHEMA.xml --out build/s
      promptcache run PROMPT.xml --compiled build/s
      promptcache chat --schema SCHEMA.xml

    Exit codes: 0 ok, 1 bad input, 2 the environment (no network, no CUDA) or a usage error.
    """


for _command in (demo, run, compile, inspect, validate, bench, chat, vllm_config):
    main.add_command(_command)

if __name__ == "__main__":
    main()
