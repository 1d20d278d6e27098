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

Browser rules: bound to a loopback address the server answers only ``Host`` names of this
machine (``limits.LOOPBACK_HOSTS``) unless ``--allowed-hosts`` says otherwise; bound elsewhere it
answers any ``Host`` unless ``--allowed-hosts`` lists them. CORS is off unless ``--cors-origin``.
Request limits: one option per ``limits.Limits`` field (``--max-request-bytes`` ...); the serving
core: one option per ``backend.ServingConfig`` field (``--kv-pool-tokens`` ...).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import sys
from pathlib import Path

import click

from ..frontend.errors import guard
from ..frontend.options import engine_config, engine_options, model_options
from .backend import ServingConfig
from .compute import ComputeThread
from .limits import LOOPBACK_HOSTS, Limits

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


def config_options(cls, into: str, kind, help_of):
    """A decorator adding one option per field of the dataclass ``cls`` (``--name-with-dashes``,
    default: the field's; ``kind(field)``: its click type; ``help_of(field)``: its help), whose
    values reach the command as one ``cls`` instance under ``into``."""
    fields = dataclasses.fields(cls)

    def decorate(f):
        @functools.wraps(f)
        def wrapper(*args, **kwargs):
            kwargs[into] = cls(**{fl.name: kwargs.pop(fl.name) for fl in fields})
            return f(*args, **kwargs)

        for fl in reversed(fields):
            wrapper = click.option(f"--{fl.name.replace('_', '-')}", fl.name, default=fl.default, show_default=True,
                                   type=kind(fl), help=help_of(fl))(wrapper)
        return wrapper

    return decorate


limit_options = config_options(  # one ``--max-...`` option per ``Limits`` field
    Limits, "limits", lambda fl: click.IntRange(min=1),
    lambda fl: f"Request limit: {fl.name.removeprefix('max_')} (refused with 400/413 before any work).")
serving_options = config_options(  # one option per ``ServingConfig`` field, its help from the field
    ServingConfig, "serving",
    lambda fl: click.FloatRange(min=0, min_open=True) if isinstance(fl.default, float) else click.IntRange(min=1),
    lambda fl: fl.metadata["help"])


def host_list(host: str, allowed: tuple[str, ...]) -> tuple[str, ...] | None:
    """The ``Host`` names answered: ``--allowed-hosts`` (comma-separated, repeatable; ``*`` any),
    else this machine's names when bound to loopback, else any (None)."""
    names = tuple(n.strip() for a in allowed for n in a.split(",") if n.strip())
    if names:
        return None if "*" in names else names
    return LOOPBACK_HOSTS if host in LOOPBACK else None


def _load_namespaces(pc, namespaces: list[str], schemas, compiled, documents, src_root) -> dict:
    """Every schema, compiled schema and document set, once per namespace (tenants never share a
    stored state); ``{namespace: DocumentStore}``. PMLError, artifact mismatches, document store
    errors: one line each (``guard``)."""
    from ..progress import progress_for

    docs = {}
    for ns in namespaces:
        for f in schemas:
            click.echo(f"Encoding schema {f} (namespace '{ns}') ...", err=True)
            pc.add_schema(Path(f), progress_for(Path(f).name), namespace=ns, allow_src_root=src_root)
        for d in compiled:
            click.echo(f"Loading compiled schema {d} (namespace '{ns}') ...", err=True)
            pc.load_compiled(d, namespace=ns)
        if documents:
            click.echo(f"Loading documents from {documents} (namespace '{ns}') ...", err=True)
            docs[ns] = load_documents(pc, Path(documents), ns)
    return docs


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


def _model(positional: str | None, option: str) -> str:
    """MODEL as an argument (vLLM's spelling) or ``--model``; both must agree."""
    if positional is None:
        return option
    source = click.get_current_context().get_parameter_source("model")
    if source is click.core.ParameterSource.COMMANDLINE and option != positional:
        raise click.UsageError(f"MODEL is '{positional}' but --model is '{option}': give one")
    return positional


def _keys(key_file: str | None, listed: tuple[str, ...], namespace: str) -> dict[str, str] | None:
    """{key: namespace} from the key file and the ``--api-key`` keys (the engine's namespace)."""
    try:
        keys = read_key_file(key_file) if key_file else {}
    except (OSError, ValueError) as e:
        raise click.ClickException(str(e)) from None
    for key in listed:
        if not key.strip() or key in keys:
            raise click.UsageError(f"--api-key {key!r}: empty, or given twice (or also in the key file)")
        keys[key] = namespace
    return keys or None


@click.command("serve")
@click.argument("model_arg", metavar="[MODEL]", required=False)
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
@click.option("--host", default="127.0.0.1", show_default=True,
              help="Address to bind: 127.0.0.1 serves this machine only, 0.0.0.0 every network.")
@click.option("--port", default=8000, show_default=True, type=int, help="TCP port to listen on.")
@click.option("--api-key-file", type=click.Path(exists=True, dir_okay=False), default=None,
              help="Lines 'KEY NAMESPACE'; keys map to cache namespaces (tenants).")
@click.option("--api-key", "api_key_list", multiple=True,
              help="A key clients must send (repeatable); these keys share the engine's namespace.")
@click.option("--max-queue", default=256, show_default=True, type=int, help="Requests admitted at once (503 beyond).")
@serving_options
@click.option("--drain-timeout", default=10.0, show_default=True, type=float,
              help="Seconds running requests may finish at shutdown (SIGTERM, Ctrl-C) before they are cancelled.")
@click.option("--served-model-name", "--model-name", "model_name", default=None,
              help="The model id clients send (default: the model as given).")
@click.option("--max-model-len", type=click.IntRange(min=1), default=None,
              help="Prompt plus answer tokens a request may use (default: the model's context).")
@click.option("--allowed-hosts", multiple=True, help="Host header names answered, comma-separated or repeated; '*' "
              "any (default: localhost names when bound to loopback, else any).")
@click.option("--cors-origin", "cors_origins", multiple=True,
              help="An origin (https://app.example) whose browser pages may call the API (repeatable; default none).")
@limit_options
@click.option("--cache-gb", default=4.0, show_default=True, type=float,
              help="Memory for stored states (prefix blocks, schemas, documents) in GiB; the least recently "
                   "used spill to disk beyond it. --device-budget / --host-budget (or their environment "
                   "variables or config keys) override it per tier.")
@click.option("--pin-gb", default=1.0, show_default=True, type=float,
              help="Memory that Anthropic cache_control breakpoints may pin at once (GiB); a request that "
                   "would pin more is refused with a 400.")
@guard
def serve(model_arg, model, device, dtype, engine, config_file, src_root, schemas, compiled, documents, host, port,
          api_key_file, api_key_list, max_queue, serving, drain_timeout, model_name, max_model_len, allowed_hosts, cors_origins, limits, cache_gb, pin_gb):
    """Serve an OpenAI-compatible API (chat, completions, models, health, metrics) and Anthropic's
    Messages API that reuse attention states across requests. MODEL (or --model): a Hugging Face id,
    a local directory, 'smollm2' or 'embedded'. Needs the 'serve' extra."""
    try:
        import uvicorn
    except ImportError:
        raise click.ClickException("the server needs the 'serve' extra: pip install 'promptcache[serve]'") from None
    from ..frontend.common import load_engine
    from ..store import Pins
    from .app import create_app

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    model = _model(model_arg, model)
    budget = int(cache_gb * 2**30)  # the lowest precedence: a budget from anywhere else wins
    config = engine_config(engine, config_file, defaults={"device_budget": budget, "host_budget": budget})
    keys = _keys(api_key_file, api_key_list, config.namespace)
    # the model is loaded, encoded and served on one thread (compute.py: why)
    compute = ComputeThread()
    pc = compute.call(load_engine, model, device, dtype, config)  # errors: one line and an exit code (frontend.errors.guard)
    namespaces = sorted(set(keys.values())) if keys else [pc.config.namespace]
    docs = compute.call(_load_namespaces, pc, namespaces, schemas, compiled, documents, src_root)
    try:
        app = create_app(pc, api_keys=keys, documents=docs or None, max_queue=max_queue, model_name=model_name or model,
                         block_size=serving.block_size, serving=serving, drain_timeout=drain_timeout, limits=limits,
                         allowed_hosts=host_list(host, allowed_hosts), cors_origins=cors_origins,
                         pins=Pins(int(pin_gb * 2**30)), max_model_len=max_model_len,
                         compute=compute)
    except ValueError as e:
        raise click.UsageError(f"--max-model-len: {e}") from None
    if keys is None:
        click.echo("No --api-key / --api-key-file: no keys are checked and every client shares one namespace; "
                   f"{'binding ' + host + ' (this machine only)' if host in LOOPBACK else 'WARNING: ' + host + ' is reachable by others'}.",
                   err=True)
    else:
        click.echo(f"{len(keys)} API keys in {len(namespaces)} namespaces.", err=True)
    click.echo(f"Ready: http://{host}:{port}/v1 (model '{model_name or model}'); Ctrl-C stops.", err=True)
    sys.stderr.flush()
    # uvicorn waits for open connections this long at shutdown (a stalled stream included), then the
    # app's shutdown drains the engine for the same time
    uvicorn.run(app, host=host, port=port, log_level="warning", timeout_graceful_shutdown=drain_timeout)
    click.echo("Stopped.", err=True)
