"""``promptcache vllm-config``: the ``--kv-transfer-config`` JSON that serves compiled schemas from vLLM."""

from __future__ import annotations

import json

import click

from ..frontend.errors import guard


@click.command("vllm-config")
@click.option("--compiled", "compiled", multiple=True, type=click.Path(file_okay=False, exists=True),
              help="A compiled schema folder (`promptcache compile`); repeat for several.")
@click.option("--documents", "documents", multiple=True, type=click.Path(file_okay=False, exists=True),
              help="A DocumentStore folder (made with attach_separator=True); repeat for several.")
@click.option("--remote", default=None, metavar="URL",
              help="The Redis a promptcache engine publishes to (StoreConfig.remote): states requests name by key.")
@click.option("--spill-dir", "spill_dir", default=None, type=click.Path(file_okay=False, exists=True),
              help="A promptcache engine's spill folder (StoreConfig.spill_dir): states requests name by key.")
@click.option("--load-failure-policy", "failure_policy", type=click.Choice(["fail", "recompute"]), default="fail",
              show_default=True, help="vLLM's kv_load_failure_policy for a state that fails on a worker after the "
                                      "scheduler's checks: fail the request, or compute it as a plain prefill.")
@guard
def vllm_config(compiled, documents, remote, spill_dir, failure_policy):
    """Print vLLM's --kv-transfer-config for serving COMPILED schemas' and DOCUMENTS stores' states,
    or the states an engine wrote to its REMOTE Redis or SPILL-DIR (one JSON line, last).

    \b
    vllm serve MODEL --kv-transfer-config "$(promptcache vllm-config --compiled build/s | tail -1)"
    (with promptcache importable by vLLM's Python; docs/vllm.md). Clients send prompts with
    promptcache.integrations.vllm.to_vllm_request.
    """
    from ..integrations.vllm import kv_transfer_config  # reads manifests (torch): not at `promptcache --help`

    click.echo(json.dumps(kv_transfer_config(compiled, documents, remote, spill_dir, failure_policy), separators=(",", ":")))
