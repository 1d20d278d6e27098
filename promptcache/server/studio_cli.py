"""``promptcache studio SCHEMA... [--model M]``: the studio for a schema's author, no server needed.

It is the server's app on a local model (this machine only, no keys), with the given schemas
encoded and their PML texts in the schema view's editor: lay out an edit, see its errors at their
line, send prompts and watch the cache, then save the file and start again to encode the edit.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import click

from ..frontend.errors import guard
from .core.compute import ComputeThread


@click.command("studio")
@click.argument("schemas", nargs=-1, required=True, type=click.Path(exists=True, dir_okay=False))
@click.option("--model", "-m", default="embedded", show_default=True,
              help="A Hugging Face id, a local directory, 'smollm2', 'gemma3-270m' or 'embedded' (random weights: noise answers).")
@click.option("--device", default=None, help="cpu, cuda, cuda:1 ... (default: cuda when available).")
@click.option("--dtype", default="auto", show_default=True, type=click.Choice(("auto", "float32", "bfloat16", "float16")))
@click.option("--port", default=8765, show_default=True, help="Port on 127.0.0.1 the page is served on.")
@click.option("--src-root", type=click.Path(exists=True, file_okay=False), default=None,
              help="Folder src= files may come from (default: each schema file's folder).")
@guard
def studio(schemas, model, device, dtype, port, src_root):
    """Open the studio on SCHEMA files: their layout on the position axis, prompts coloured by
    where their states come from, and the cache, at http://127.0.0.1:PORT/studio.

    \b
    Example:
      promptcache studio schemas/travel.xml --model smollm2
    """
    try:
        import uvicorn
    except ImportError:
        raise click.ClickException("the studio needs the 'serve' extra: pip install 'promptcache[serve]'") from None
    from ..frontend.common import load_engine
    from ..progress import progress_for
    from .app import create_app

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    compute = ComputeThread()  # one thread for torch work (compute.py: why)
    pc = compute.call(load_engine, model, device, dtype)
    sources = {}
    for f in schemas:
        click.echo(f"Encoding schema {f} ...", err=True)
        entry = compute.call(pc.add_schema, Path(f), progress_for(Path(f).name), allow_src_root=src_root)
        sources[entry.name] = Path(f).read_text(encoding="utf-8")
    app = create_app(pc, model_name=model, compute=compute)
    app.state.studio_sources = sources  # the editor starts from each schema's text
    click.echo(f"Studio: http://127.0.0.1:{port}/studio (model '{model}'); Ctrl-C stops.", err=True)
    sys.stderr.flush()
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning")
