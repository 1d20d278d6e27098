"""``promptcache chat``: a terminal chat whose turns reuse the states of the turns before.

Each turn is a PML prompt: the schema's modules (``--use``, default: every top-level module, and
each union's scaffold member), then the conversation so far, then the new user message. Its
tokens in prompt order (``pc.layout(...).token_ids``, positions 0..n-1) go through the server's
``PrefixCache``: the blocks of the previous turns' prompts are stored, so a turn runs only what
is new since the last stored block (exact reuse: the same tokens at the same positions). The
first turn stores the schema's text; each later turn reports the tokens it reused.
"""

from __future__ import annotations

import sys
from pathlib import Path
from xml.sax.saxutils import escape

import click

from .common import load_engine, setup_logging
from .errors import guard
from .options import engine_config, engine_options, model_options

QUIT = ("/quit", "/exit")


def default_imports(layout) -> list[str]:
    """Top-level modules outside unions, and each union's scaffold (or first) member, in schema order."""
    members = {m: u for u in layout.unions.values() for m in u.members}
    out = []
    for m in layout.modules.values():
        name = "/".join(m.path)
        if len(m.path) != 1:
            continue
        u = members.get(name)
        if u is None or name == (u.scaffold or u.members[0]):
            out.append(name)
    return out


def import_tag(layout, name: str) -> str:
    """``<name p="scaffold" .../>``: a module import whose parameters take their scaffold text."""
    module = layout.modules.get(tuple(name.split("/")))
    params = module.params.items() if module is not None else ()
    args = "".join(f' {p}="{escape(spec.scaffold or "", {chr(34): "&quot;"})}"' for p, (_, spec) in params)
    return f"<{name}{args}/>"


def turn_prompt(schema: str | None, imports: list[str], history: list[tuple[str, str]], user: str) -> str:
    """The PML prompt of one turn; ``imports`` are import tags (``import_tag``)."""
    roles = "".join(f"<user>{escape(u)}</user><assistant>{escape(a)}</assistant>" for u, a in history)
    body = "".join(imports) + roles + f"<user>{escape(user)}</user>"
    return f'<prompt schema="{schema}">{body}</prompt>' if schema else f"<prompt>{body}</prompt>"


@click.command()
@click.option("--schema", "-s", type=click.Path(exists=True, dir_okay=False), default=None,
              help="A schema file whose modules open every turn (omit for a plain chat).")
@click.option("--use", "imports", multiple=True, help="Module to import (repeatable; default: every top-level one).")
@model_options
@engine_options
@click.option("--block-size", default=16, show_default=True, type=int, help="Tokens per reusable block.")
@click.option("--max-new-tokens", default=64, show_default=True)
@guard
def chat(schema, imports, model, device, dtype, engine, config_file, block_size, max_new_tokens):
    """Chat in the terminal; each turn reuses the states of the turns before it and shows its
    TTFT and cached tokens. /quit or end of input (Ctrl-D) ends.

    \b
    Example:
      promptcache chat --schema SCHEMA.xml --model smollm2
    """
    from ..server.prefix import PrefixCache

    setup_logging()
    config = engine_config(engine, config_file)
    pc = load_engine(model, device, dtype, config)
    name = None
    if schema:
        layout = pc.add_schema(Path(schema)).layout
        name = layout.name
        names = list(imports) or default_imports(layout)
        imports = [import_tag(layout, n) for n in names]
        click.echo(f"Schema '{name}': importing {', '.join(names) or 'nothing'}", err=True)
    prefix = PrefixCache(pc, block_size)
    history: list[tuple[str, str]] = []
    click.echo("Type a message; /quit ends.")
    while True:
        click.echo("you> ", nl=False)
        sys.stdout.flush()
        line = sys.stdin.readline()
        if not line or line.strip() in QUIT:
            click.echo("")
            break
        user = line.strip()
        if not user:
            continue
        ids = pc.layout(turn_prompt(name, list(imports), history, user)).token_ids
        out = pc.generate_from(prefix.starter(list(ids), pc.config.namespace), max_new_tokens=max_new_tokens)
        click.echo(f"bot> {out.text.strip()}")
        click.echo(f"[TTFT {out.ttft * 1e3:.1f} ms | cached {out.cached_tokens} tokens | new {out.new_tokens} tokens]")
        history.append((user, out.text.strip()))
