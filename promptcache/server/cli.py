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
Settings: one option per ``ServerConfig`` leaf (``config.py``: ``--host``, ``--port``,
``--max-queue`` ...; its ``serving`` section ``--kv-pool-tokens`` ..., its ``limits`` section
``--max-request-bytes`` ...), generated as the engine's are (``frontend/walker.py``), also read
from ``PROMPTCACHE_<FIELD>`` and the config file's ``[server]`` tables. The model, what to load,
the keys and the served name are the command's own options. Budgets of stored states are the
store's (``--host-budget``, ``--device-budget``, ``--pin-budget``: sizes such as 4GiB).
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import click

from ..frontend.errors import guard
from ..frontend.options import engine_config, engine_options, model_options
from ..frontend.walker import SettingsCommand, settings_from, settings_options
from .core.compute import ComputeThread
from .config import ServerConfig
from .core.limits import LOOPBACK_HOSTS
from . import vllm_flags
from .vllm_flags import vllm_options

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


SERVE_DEFAULTS = {"device_budget": 4 << 30, "host_budget": 4 << 30}  # serve's memory for stored states
server_options = settings_options(ServerConfig, "server")


def serve_defaults(device: str | None, dtype: str) -> dict:
    """serve's defaults, above the dataclasses' and below everything a user sets: 4 GiB of memory
    per tier for stored states, and on a CPU the linears packed for oneDNN in float32, and in
    bfloat16 where the CPU computes it natively (what vLLM's CPU build does: about twice as fast a
    decode step, within rounding of the stock forward, eval/results/design_figures.md,
    eval/results/bf16.md; ``--no-packed-linear`` turns it off). ``auto`` resolves to one of those
    two on a CPU (models/native_dtype.py). The library's default stays off: it changes the model
    object in place, which a server that loaded the model may do, a library may not. On a GPU, decode
    steps replayed as captured CUDA graphs (``cuda_graphs``: 6.2 ms a decode step at batch 48 on an
    H200 against 20.1 ms eager, a 1B shape, eval/results/cuda_checks_2026-11-28b.md;
    ``--no-cuda-graphs`` turns it off); the library's default stays off until more GPU runs back it."""
    import torch

    from ..frontend.common import check_device
    from ..models.native_dtype import bf16_native

    device = check_device(device)
    packs = dtype in ("auto", "float32") or (dtype == "bfloat16" and bf16_native(device))
    packed = device == "cpu" and packs and torch.backends.mkldnn.is_available()
    return {**SERVE_DEFAULTS, "packed_linear": packed, "cuda_graphs": device.startswith("cuda")}


def server_config(given: dict, config_file: str | Path | None = None, env=None) -> ServerConfig:
    """The ServerConfig from command line > environment > ``[server]`` of the config file >
    defaults; a bad value is a usage error (exit 2) naming where it came from."""
    try:
        return settings_from(ServerConfig, given, config_file, env, table_path=("server",))
    except ValueError as e:
        raise click.UsageError(str(e)) from None


def host_list(host: str, allowed: tuple[str, ...]) -> tuple[str, ...] | None:
    """The ``Host`` names answered: ``--allowed-hosts`` (comma-separated, repeatable; ``*`` any),
    else this machine's names when bound to loopback, else any (None)."""
    names = tuple(n.strip() for a in allowed for n in a.split(",") if n.strip())
    if names:
        return None if "*" in names else names
    return LOOPBACK_HOSTS if host in LOOPBACK else None


def _load_namespaces(pc, namespaces: list[str], schemas, compiled, documents, src_root,
                     documents_system: str | None = None) -> dict:
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
            docs[ns] = load_documents(pc, Path(documents), ns, documents_system)
    return docs


def load_documents(pc, folder: Path, namespace: str, system: str | None = None):
    """A DocumentStore for ``namespace``: a persisted store (``index.json`` in ``folder``) or,
    otherwise, every ``*.txt`` / ``*.md`` file in ``folder`` as a document whose id is the file stem.
    ``system``: the store's system text (documents encoded after the prefix of a request with it;
    requests without system messages carry it). A persisted store opened without one keeps the
    encoding its folder records; with one that differs it is refused (the store's error)."""
    from ..rag import DocumentStore

    if (folder / "index.json").is_file():
        return DocumentStore(pc, folder, namespace=namespace, system=system)
    store = DocumentStore(pc, None, namespace=namespace, system=system)
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


def _sized_pool(pc, settings: ServerConfig, fraction: float) -> ServerConfig:
    """``settings`` with the KV pool sized by ``--gpu-memory-utilization`` (the model loaded)."""
    import dataclasses

    import torch

    free, total = torch.cuda.mem_get_info(pc.device)
    per_token = pc.runner.spec.bytes_per_token
    tokens = vllm_flags.pool_tokens(fraction, total, free, pc.config.store.device_budget, per_token,
                                    settings.serving.block_size)
    click.echo(f"KV pool: {tokens} tokens ({tokens * per_token / 2**30:.1f} GiB), from --gpu-memory-utilization "
               f"{fraction:g} of {total / 2**30:.1f} GiB", err=True)
    return dataclasses.replace(settings, serving=dataclasses.replace(settings.serving, kv_pool_tokens=tokens))


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


@click.command("serve", cls=SettingsCommand)
@click.argument("model_arg", metavar="[MODEL]", required=False)
@model_options
@click.option("--src-root", type=click.Path(exists=True, file_okay=False), default=None,
              help="Folder src= files may come from (default: each schema file's folder).")
@click.option("--schema", "schemas", multiple=True, type=click.Path(exists=True, dir_okay=False),
              help="A PML schema to encode at start (repeatable).")
@click.option("--compiled", "compiled", multiple=True, type=click.Path(exists=True, file_okay=False),
              help="A compiled schema folder to load (repeatable).")
@click.option("--documents", type=click.Path(exists=True, file_okay=False), default=None,
              help="A DocumentStore folder (index.json) or a folder of .txt/.md documents.")
@click.option("--documents-system", default=None,
              help="The system text of document requests: documents are encoded after the prompt prefix "
                   "that carries it, so a request's first document is exact; requests with documents and no "
                   "system message carry it. Default: none (a persisted store keeps the encoding it records).")
@click.option("--api-key-file", type=click.Path(exists=True, dir_okay=False), default=None,
              help="Lines 'KEY NAMESPACE'; keys map to cache namespaces (tenants).")
@click.option("--api-key", "api_key_list", multiple=True,
              help="A key clients must send (repeatable); these keys share the engine's namespace.")
@click.option("--served-model-name", "--model-name", "model_name", default=None,
              help="The model id clients send (default: the model as given).")
@vllm_options
@server_options
@engine_options(defaults=SERVE_DEFAULTS)
@guard
def serve(model_arg, model, device, dtype, engine, config_file, server, src_root, schemas, compiled, documents,
          documents_system, api_key_file, api_key_list, model_name, vllm):
    """Serve an OpenAI-compatible API (chat, completions, models, health, metrics) and Anthropic's
    Messages API that reuse attention states across requests. MODEL (or --model): a Hugging Face id,
    a local directory, 'smollm2', 'gemma3-270m' or 'embedded'. Needs the 'serve' extra. On a CPU in float32 serve
    packs the linear layers for oneDNN unless --no-packed-linear (faster decoding)."""
    try:
        import uvicorn
    except ImportError:
        raise click.ClickException("the server needs the 'serve' extra: pip install 'promptcache[serve]'") from None
    from ..frontend.common import check_device, load_engine
    from ..store import Pins
    from .app import create_app

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    model = _model(model_arg, model)
    settings = server_config(server, config_file)
    config = engine_config(engine, config_file, defaults=serve_defaults(device, dtype))
    keys = _keys(api_key_file, api_key_list, config.namespace)
    vllm_flags.check(vllm, check_device(device), server)
    # the model is loaded, encoded and served on one thread (compute.py: why)
    compute = ComputeThread()
    pc = compute.call(load_engine, model, device, dtype, config)  # errors: one line and an exit code (frontend.errors.guard)
    if vllm["gpu_memory_utilization"] is not None:
        settings = compute.call(_sized_pool, pc, settings, vllm["gpu_memory_utilization"])
    namespaces = sorted(set(keys.values())) if keys else [pc.config.namespace]
    if documents_system is not None and documents is None:
        raise click.UsageError("--documents-system needs --documents")
    docs = compute.call(_load_namespaces, pc, namespaces, schemas, compiled, documents, src_root, documents_system)
    try:
        app = create_app(pc, api_keys=keys, documents=docs or None, max_queue=settings.max_queue,
                         model_name=model_name or model, block_size=settings.serving.block_size,
                         serving=settings.serving, drain_timeout=settings.drain_timeout, limits=settings.limits,
                         allowed_hosts=host_list(settings.host, settings.allowed_hosts),
                         cors_origins=settings.cors_origins, pins=Pins(config.store.pin_budget),
                         max_model_len=settings.max_model_len, compute=compute,
                         open_metrics=settings.open_metrics)
    except ValueError as e:
        raise click.UsageError(f"--max-model-len: {e}") from None
    if keys is None:
        host = settings.host
        click.echo("No --api-key / --api-key-file: no keys are checked and every client shares one namespace; "
                   f"{'binding ' + host + ' (this machine only)' if host in LOOPBACK else 'WARNING: ' + host + ' is reachable by others'}.",
                   err=True)
    else:
        click.echo(f"{len(keys)} API keys in {len(namespaces)} namespaces.", err=True)
    click.echo(f"Ready: http://{settings.host}:{settings.port}/v1 (model '{model_name or model}'); Ctrl-C stops.", err=True)
    sys.stderr.flush()
    # uvicorn waits for open connections this long at shutdown (a stalled stream included), then the
    # app's shutdown drains the engine for the same time
    uvicorn.run(app, host=settings.host, port=settings.port, log_level="warning",
                timeout_graceful_shutdown=settings.drain_timeout)
    click.echo("Stopped.", err=True)
