"""Compiled serving steps against eager ones, and both against the weight-bandwidth limit.

One process, one model, one KV pool holding a shared context of ``--context`` tokens. For each
batch size B: a decode step of B requests that each read the shared context in place and 16
tokens of their own, run (a) eagerly (``paged.paged_forward``) and (b) compiled
(``graphs.CompiledSteps``, ``EngineConfig.compile``), timed round-robin in the same run. The
limit of a decode step is reading every weight once: parameter bytes / the memory bandwidth
measured here (a reduction over a 1 GiB tensor on CPU, a device copy on CUDA).

The cached-prompt cell: a prompt of ``--cached-context`` tokens of which 99% are cached (read in
place from the pool) and 1% are new, served compiled and eagerly, against a full prefill of the
same tokens (the stock forward, no cache): the paper's "cached vs full" ratio.

    python -m eval.bench_compile                                   # CPU, SmolLM2, ~5 min
    python -m eval.bench_compile --device cuda --dtype bfloat16 --model embedded:1b
    python -m eval.bench_compile --device cuda --dtype bfloat16 --model embedded:8b --batches 1 32 \\
        --cached-context 8192

Prints a table of medians and ratios, writes compile.csv and compile.png (``--out``).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from promptcache.bench import load_avg, round_robin
from promptcache.engine.serving_core.graphs import CompiledSteps
from promptcache.engine.serving_core.kvpool import KVPool
from promptcache.engine.serving_core.paged import PagedRow, paged_forward
from promptcache.engine.prefill.runner import ModelRunner
from promptcache.models.loading import load_model
from promptcache.models.packed import pack_linears, packed_refusal

from .common import RESULTS, add_model_args, pyplot, write_csv

OWN = 16  # tokens of its own each decode row reads besides the shared context
CHUNK = 512  # tokens per eager forward while computing the shared context


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def bandwidth(device: torch.device) -> float:
    """Bytes per second this device reads: a sum over 1 GiB (CPU) or a 1 GiB device copy (CUDA,
    read + write counted)."""
    x = torch.ones(1 << 28, dtype=torch.float32, device=device)  # 1 GiB
    y = torch.empty_like(x) if device.type == "cuda" else None
    best = float("inf")
    for _ in range(5):
        _sync(device)
        t0 = time.perf_counter()
        if y is not None:
            y.copy_(x)
        else:
            x.sum()
        _sync(device)
        best = min(best, time.perf_counter() - t0)
    moved = x.numel() * 4 * (2 if y is not None else 1)
    return moved / best


def weight_bytes(model) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())  # a tied matrix counted once


def shared_context(runner, pool: KVPool, n: int) -> tuple[list[tuple[str, torch.Tensor]], list[int]]:
    """``n`` tokens computed once into pool blocks: the segment every request reads in place."""
    vocab = runner.model.get_input_embeddings().num_embeddings
    ids = ((torch.arange(n) * 7919 + 11) % vocab).tolist()
    blocks = pool.allocate(-(-n // pool.block_size))
    slots = pool.slots(blocks, 0, n)
    for a in range(0, n, CHUNK):
        b = min(n, a + CHUNK)
        paged_forward(runner, pool, [PagedRow(ids[a:b], list(range(a, b)), [], slots[: b], logits=False)])
    return [("context", pool.views(blocks, n)[0])], ids


def decode_rows(pool: KVPool, seg, context: int, b: int) -> list[PagedRow]:
    """B decode rows, each with OWN tokens of its own (the step writes the last of them)."""
    rows = []
    for i in range(b):
        own = pool.slots(pool.allocate(1), 0, OWN)
        pool.buf.index_fill_(3, own, 0.0)  # the row's earlier tokens: zeros (never garbage)
        rows.append(PagedRow([100 + i], [context + OWN - 1], seg, own))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_args(ap, model="smollm2")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16, 32, 64])
    ap.add_argument("--context", type=int, default=512, help="shared tokens every decode row reads")
    ap.add_argument("--cached-context", type=int, default=2048, help="the 99%%-cached prompt's tokens (0: skip)")
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--threads", type=int, default=None, help="CPU threads (default: torch's)")
    ap.add_argument("--no-packed", action="store_true", help="CPU float32: keep the stock linears")
    ap.add_argument("--out", default=str(RESULTS))
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    model_name = args.model
    if model_name == "smollm2":
        from promptcache.models.smollm2 import ensure_smollm2

        model_name = str(ensure_smollm2())
    model, tok = load_model(model_name, device=args.device, dtype=args.dtype)
    packed = not args.no_packed and packed_refusal(model) is None
    if packed:
        pack_linears(model)
    runner = ModelRunner(model, tok)
    dev = runner.device
    bw = bandwidth(dev)
    limit_s = weight_bytes(model) / bw
    print(f"{args.model} on {dev} ({args.dtype}{', packed linears' if packed else ''}); weights "
          f"{weight_bytes(model) / 2**20:.0f} MiB, bandwidth {bw / 1e9:.1f} GB/s -> decode limit {limit_s * 1e3:.2f} ms; "
          f"load {load_avg():.2f}")

    total = args.context + OWN * sum(args.batches) + 2 * (args.cached_context + 256) + 1024
    pool = KVPool(runner.spec, dev, total, 16)
    seg, _ = shared_context(runner, pool, args.context)
    steps = CompiledSteps(runner)
    rows = []
    for b in args.batches:
        step_rows = decode_rows(pool, seg, args.context, b)
        methods = {"eager": lambda r=step_rows: (paged_forward(runner, pool, r), _sync(dev)),
                   "compiled": lambda r=step_rows: (steps.forward(pool, r), _sync(dev))}
        t0 = time.perf_counter()
        methods["compiled"]()  # compiles this bucket (or loads it from the disk cache)
        compile_s = time.perf_counter() - t0
        med = round_robin(methods, args.rounds)
        rows.append(dict(cell=f"decode B={b}", batch=b, eager_ms=med["eager"] * 1e3, compiled_ms=med["compiled"] * 1e3,
                         speedup=med["eager"] / med["compiled"], limit_ms=limit_s * 1e3,
                         compiled_over_limit=med["compiled"] / limit_s, compile_s=compile_s))
        print(f"decode B={b:3d}: eager {med['eager'] * 1e3:8.2f} ms  compiled {med['compiled'] * 1e3:8.2f} ms  "
              f"{med['eager'] / med['compiled']:.2f}x  compiled/limit {med['compiled'] / limit_s:.2f}  "
              f"(compile {compile_s:.1f} s)")
    if args.cached_context:
        rows.append(cached_prompt(runner, pool, steps, args.cached_context, args.rounds, dev))
    path = write_csv("compile.csv", rows, args.out)
    plot(rows, Path(args.out) / "compile.png", args.model)
    print(f"wrote {path}")


def cached_prompt(runner, pool: KVPool, steps: CompiledSteps, n: int, rounds: int, dev) -> dict:
    """A prompt of n tokens, 99% cached: its new tokens' step (compiled, eager) vs a full prefill."""
    new = max(1, n // 100)
    seg, ids = shared_context(runner, pool, n - new)
    own = pool.slots(pool.allocate(-(-new // pool.block_size)), 0, new)
    row = [PagedRow(ids[:new], list(range(n - new, n)), seg, own)]
    full_ids = torch.tensor([ids + ids[:new]], device=dev)

    def full():
        with torch.inference_mode():
            runner.model(input_ids=full_ids, use_cache=False, logits_to_keep=1)
        _sync(dev)

    methods = {"full": full, "eager": lambda: (paged_forward(runner, pool, row), _sync(dev)),
               "compiled": lambda: (steps.forward(pool, row), _sync(dev))}
    methods["compiled"]()
    med = round_robin(methods, max(3, rounds // 3))
    print(f"cached prompt {n} tokens ({new} new): full {med['full'] * 1e3:.1f} ms, eager {med['eager'] * 1e3:.1f} ms "
          f"({med['full'] / med['eager']:.1f}x), compiled {med['compiled'] * 1e3:.1f} ms ({med['full'] / med['compiled']:.1f}x)")
    return dict(cell=f"cached {n} ({new} new)", batch=1, eager_ms=med["eager"] * 1e3, compiled_ms=med["compiled"] * 1e3,
                speedup=med["eager"] / med["compiled"], limit_ms=med["full"] * 1e3,
                compiled_over_limit=med["full"] / med["compiled"], compile_s=0.0)


def plot(rows: list[dict], path: Path, model: str) -> None:
    plt = pyplot()
    if plt is None:
        return
    dec = [r for r in rows if r["cell"].startswith("decode")]
    fig, ax = plt.subplots(figsize=(7, 4))
    xs = range(len(dec))
    ax.bar([x - 0.2 for x in xs], [r["eager_ms"] for r in dec], 0.4, label="eager")
    ax.bar([x + 0.2 for x in xs], [r["compiled_ms"] for r in dec], 0.4, label="compiled")
    ax.axhline(dec[0]["limit_ms"], color="k", ls="--", lw=1, label="weight-bandwidth limit")
    ax.set_xticks(list(xs), [str(r["batch"]) for r in dec])
    ax.set_xlabel("decode rows in the step")
    ax.set_ylabel("ms per step (median)")
    ax.set_title(f"Compiled vs eager serving steps ({model})")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
