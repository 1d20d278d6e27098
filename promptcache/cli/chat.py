"""``promptcache chat``: a terminal chat whose turns reuse the states of the schema and of the turns
before (``chat_session.ChatSession`` holds the state and says how a turn is served)."""

from __future__ import annotations

import sys
from pathlib import Path

import click

from ..tunables import BLOCK_SIZE
from .chat_session import ChatSession, default_imports, left_out
from ..frontend.common import load_engine, setup_logging
from ..frontend.errors import guard
from ..frontend.options import engine_config, engine_options, model_options
from ..frontend.walker import SettingsCommand

QUIT = ("/quit", "/exit")


@click.command(cls=SettingsCommand)
@click.option("--schema", "-s", type=click.Path(exists=True, dir_okay=False), default=None,
              help="A schema file whose modules open every turn (omit for a plain chat).")
@click.option("--use", "imports", multiple=True,
              help="Module to import, with p=value words filling its parameters (repeatable; default: every "
                   "top-level module outside a union and without parameters).")
@model_options
@engine_options
@click.option("--block-size", default=BLOCK_SIZE, show_default=True, type=click.IntRange(min=1),
              help="Tokens per reusable block (the server's default too).")
@click.option("--max-new-tokens", default=64, show_default=True, help="Most tokens per answer.")
@guard
def chat(schema, imports, model, device, dtype, engine, config_file, block_size, max_new_tokens):
    """Chat in the terminal; each turn reuses stored states (the schema's modules from the first
    turn, then the turns before) and shows its TTFT, cached tokens and whether the state is exact.
    /help lists the commands; /quit or end of input (Ctrl-D) ends.

    \b
    Example:
      promptcache chat --schema SCHEMA.xml --model smollm2
    """
    setup_logging()
    config = engine_config(engine, config_file)
    pc = load_engine(model, device, dtype, config)
    layout = pc.add_schema(Path(schema)).layout if schema else None
    from ..engine import ServingConfig  # torch: imported when chat runs, not for `promptcache --help`

    session = ChatSession(pc, pc.engine(ServingConfig(block_size=block_size)), layout)
    if layout is not None:
        if imports:
            click.echo(session.command("/use " + " ".join(imports)), err=True)
        else:
            session.imports = default_imports(layout)
        click.echo(f"Schema '{layout.name}': importing {', '.join(session.imports) or 'nothing'} "
                   "(/modules lists the rest, /use picks)", err=True)
        waiting = left_out(layout, session.imports)
        if waiting:
            click.echo(f"  with parameters, imported when you fill them: {'; '.join(waiting)} "
                       "(/use NAME p=value ...)", err=True)
    click.echo("Type a message; /help lists commands, /quit ends.")
    _loop(session, max_new_tokens)


def _loop(session: ChatSession, max_new_tokens: int) -> None:
    while True:
        click.echo("you> ", nl=False)
        sys.stdout.flush()
        line = sys.stdin.readline()
        if not line or line.strip() in QUIT:
            click.echo("")
            return
        user = line.strip()
        if not user:
            continue
        reply = session.command(user)
        if reply is not None:
            click.echo(reply)
            continue
        out, via_schema, ids = session.answer(user, max_new_tokens)
        click.echo(f"bot> {out.text.strip()}")
        click.echo(session.stats(out))
        sys.stdout.flush()
        if via_schema:
            session.store_blocks(ids)
