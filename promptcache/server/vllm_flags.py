"""vLLM's serve flags that a vLLM user brings along: accepted where they mean something here,
refused with what to use where they do not.

- ``--enable-prefix-caching``: accepted; prefix caching is always on (every full block of every
  prompt is stored and reused), so it changes nothing.
- ``--gpu-memory-utilization F``: the fraction of the GPU's memory this server may hold; after the
  model loads, the KV pool (``--kv-pool-tokens``) gets what is left of it, less the device tier's
  budget for stored states (``--device-budget``). On a CPU it is refused: size the pool in tokens.
- ``--tensor-parallel-size N``: 1 is accepted; more is refused: one model copy per process, on one
  device. Several GPUs serve as replicas behind a router (docs/scaling.md); a model too large for
  one GPU is vLLM's to split, with promptcache's vLLM connector serving the stored states.
"""

from __future__ import annotations

import click

__all__ = ["check", "pool_tokens", "vllm_options"]

TP_REFUSAL = ("--tensor-parallel-size {n}: promptcache runs one copy of the model per process on one device, "
              "so it does not split a model across GPUs. Run one `promptcache serve` replica per GPU behind "
              "sglang-router (docs/scaling.md), or, for a model too large for one GPU, serve it with vLLM, which "
              "splits it, and serve the schemas' stored states there through promptcache's vLLM connector "
              "(promptcache.integrations.vllm, loaded by vLLM's --kv-transfer-config).")
CPU_REFUSAL = ("--gpu-memory-utilization sizes the KV pool from a GPU's memory, and this server runs on {device}: "
               "size the pool in tokens with --kv-pool-tokens N instead (default 32768).")


def vllm_options(f):
    """The three flags, as options of ``serve`` (their values reach it as ``vllm``: a dict)."""
    import functools

    @functools.wraps(f)
    def wrapper(*args, **kwargs):
        kwargs["vllm"] = {k: kwargs.pop(k) for k in ("enable_prefix_caching", "gpu_memory_utilization",
                                                     "tensor_parallel_size")}
        return f(*args, **kwargs)

    for option in reversed([
        click.option("--enable-prefix-caching", is_flag=True,
                     help="vLLM's flag, accepted: prefix caching is always on here."),
        click.option("--gpu-memory-utilization", type=click.FloatRange(0, 1, min_open=True), default=None,
                     help="vLLM's flag: the fraction of the GPU's memory this server may hold; the KV pool gets "
                          "what the model and --device-budget leave of it (GPU only; sets --kv-pool-tokens)."),
        click.option("--tensor-parallel-size", type=click.IntRange(min=1), default=None,
                     help="vLLM's flag: 1 only (one model copy per process); several GPUs serve as replicas "
                          "behind a router."),
    ]):
        wrapper = option(wrapper)
    return wrapper


def check(vllm: dict, device: str, server: dict) -> None:
    """Refuse what cannot be honoured, before anything loads (a usage error names the fix)."""
    n = vllm["tensor_parallel_size"]
    if n is not None and n > 1:
        raise click.UsageError(TP_REFUSAL.format(n=n))
    if vllm["gpu_memory_utilization"] is not None:
        if not device.startswith("cuda"):
            raise click.UsageError(CPU_REFUSAL.format(device=device))
        if "kv_pool_tokens" in server:
            raise click.UsageError("--gpu-memory-utilization and --kv-pool-tokens both size the KV pool: give one")


def pool_tokens(fraction: float, total: int, free: int, reserved: int, bytes_per_token: int, block_size: int) -> int:
    """KV pool tokens for ``fraction`` of a device of ``total`` bytes with ``free`` bytes free now
    (the model loaded), keeping ``reserved`` bytes (the device tier's budget) aside; whole blocks.
    A fraction the device's current use already passes is a usage error naming both figures."""
    allowed = int(fraction * total) - (total - free) - reserved
    tokens = max(allowed, 0) // bytes_per_token // block_size * block_size
    if tokens < block_size:
        gib = 2**30
        raise click.UsageError(
            f"--gpu-memory-utilization {fraction:g} allows {fraction * total / gib:.1f} GiB of the GPU's "
            f"{total / gib:.1f} GiB, but {(total - free) / gib:.1f} GiB are in use (the model, other processes) "
            f"and --device-budget keeps {reserved / gib:.1f} GiB for stored states: no room for a KV pool. "
            "Raise the fraction or lower --device-budget.")
    return tokens
