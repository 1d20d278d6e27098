"""The ``serve`` command: load the model, schemas and documents with progress, then run uvicorn.

Key file (``--api-key-file F``): one ``KEY NAMESPACE`` pair per line, separated by whitespace;
blank lines and lines starting with ``#`` are ignored. Keys are unique; several keys may share a
namespace (they then share cached states). Every schema, compiled schema and document set is
loaded once per namespace, so tenants never share a stored state.

Restart: with a named ``--spill-dir`` the disk tier indexes the states found there at start, and
on SIGINT / SIGTERM the app's shutdown writes the states held in memory there
(``TieredStore.persist``, within ``--disk-budget``), so a replica restarted on its folder serves
from it at once. (uvicorn re-raises SIGTERM after its shutdown: the exit status is then -15.)

Binding: ``--host`` defaults to 127.0.0.1 (only this machine); without a key file anyone who can
reach the port can use the server, and the command says so.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import click

from ..cli.errors import guard
from ..cli.options import engine_config, engine_options, model_options

LOOPBACK = {"127.0.0.1", "localhost", "::1"}


def read_key_file(path: str | Path) -> dict[str, str]:
    """``{key: namespace}`` from a key file; a malformed line is a ValueError naming file:line."""
    keys: dict[str, str] = {}
    for n, line in enumerate(Path(path).read_text(encoding="utf-8").splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        parts = line.split()
        if len(parts) != 2:
            raise ValueError(f"{path}:{n}: expected 'KEY NAMESPACE', got {len(parts)} fields")
        if parts[0] in keys:
            raise ValueError(f"{path}:{n}: key listed twice")
        keys[parts[0]] = parts[1]
    if not keys:
        raise ValueError(f"{path}: no keys (one 'KEY NAMESPACE' per line)")
    return keys


def load_documents(pc, folder: Path, namespace: str):
    """A DocumentStore for ``namespace``: a persisted store (``index.json`` in ``folder``) or,
    otherwise, every ``*.txt`` / ``*.md`` file in ``folder`` as a document whose id is the file stem."""
    from ..rag import DocumentStore

    if (folder / "index.json").is_file():
        return DocumentStore(pc, folder, namespace=namespace)
    store = DocumentStore(pc, None, namespace=namespace)
    files = sorted(p for p in folder.iterdir() if p.suffix in (".txt", ".md"))
    if not files:
        raise click.UsageError(f"--documents {folder}: no index.json and no .txt/.md files")
    for p in files:
        store.add(p.stem, p.read_text(encoding="utf-8"), {"source": str(p)})
    return store


@click.command("serve")
@model_options
@engine_options
@click.option("--src-root", type=click.Path(exists=True, file_okay=False), default=None,
              help="Folder src= files may come from (default: each schema file's folder).")
@click.option("--schema", "schemas", multiple=True, type=click.Path(exists=True, dir_okay=False),
              help="A PML schema to encode at start (repeatable).")
@click.option("--compiled", "compiled", multiple=True, type=click.Path(exists=True, file_okay=False),
              help="A compiled schema folder to load (repeatable).")
@click.option("--documents", type=click.Path(exists=True, file_okay=False), default=None,
              help="A DocumentStore folder (index.json) or a folder of .txt/.md documents.")
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", default=8000, show_default=True, type=int)
@click.option("--api-key-file", type=click.Path(exists=True, dir_okay=False), default=None,
              help="Lines 'KEY NAMESPACE'; keys map to cache namespaces (tenants).")
@click.option("--max-queue", default=64, show_default=True, type=int, help="Requests admitted at once (503 beyond).")
@click.option("--block-size", default=64, show_default=True, type=int, help="Tokens per prefix-reuse block.")
@click.option("--model-name", default=None, help="The model id clients send (default: --model).")
@click.option("--cache-gb", default=4.0, show_default=True, type=float,
              help="Memory for stored states (prefix blocks, schemas, documents) in GiB; the least recently "
                   "used spill to disk beyond it. --device-budget / --host-budget (or their environment "
                   "variables or config keys) override it per tier.")
@guard
def serve(model, device, dtype, engine, config_file, src_root, schemas, compiled, documents, host, port,
          api_key_file, max_queue, block_size, model_name, cache_gb):
    """Serve an OpenAI-compatible API (chat, completions, models, health, metrics) that reuses
    attention states across requests. Needs the 'serve' extra."""
    try:
        import uvicorn
    except ImportError:
        raise click.ClickException("the server needs the 'serve' extra: pip install 'promptcache[serve]'") from None
    from ..cli.common import load_engine
    from ..progress import progress_for
    from .app import create_app

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        keys = read_key_file(api_key_file) if api_key_file else None
    except (OSError, ValueError) as e:
        raise click.ClickException(str(e)) from None
    budget = int(cache_gb * 2**30)  # the lowest precedence: a budget from anywhere else wins
    config = engine_config(engine, config_file, defaults={"device_budget": budget, "host_budget": budget})
    pc = load_engine(model, device, dtype, config)  # errors: one line and an exit code (cli.errors.guard)
    namespaces = sorted(set(keys.values())) if keys else [pc.config.namespace]
    docs = {}
    for ns in namespaces:  # PMLError, artifact mismatches, document store errors: one line each (guard)
        for f in schemas:
            click.echo(f"Encoding schema {f} (namespace '{ns}') ...", err=True)
            pc.add_schema(Path(f), progress_for(Path(f).name), namespace=ns, allow_src_root=src_root)
        for d in compiled:
            click.echo(f"Loading compiled schema {d} (namespace '{ns}') ...", err=True)
            pc.load_compiled(d, namespace=ns)
        if documents:
            click.echo(f"Loading documents from {documents} (namespace '{ns}') ...", err=True)
            docs[ns] = load_documents(pc, Path(documents), ns)
    app = create_app(pc, api_keys=keys, documents=docs or None, max_queue=max_queue,
                     model_name=model_name or model, block_size=block_size)
    if keys is None:
        click.echo("No --api-key-file: no keys are checked and every client shares one namespace; "
                   f"{'binding ' + host + ' (this machine only)' if host in LOOPBACK else 'WARNING: ' + host + ' is reachable by others'}.",
                   err=True)
    else:
        click.echo(f"{len(keys)} API keys in {len(namespaces)} namespaces.", err=True)
    click.echo(f"Ready: http://{host}:{port}/v1 (model '{model_name or model}'); Ctrl-C stops.", err=True)
    sys.stderr.flush()
    uvicorn.run(app, host=host, port=port, log_level="warning")
    click.echo("Stopped.", err=True)
