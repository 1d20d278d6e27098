"""bfloat16 against float32 on the CPU: a 2K-token prefill and decode steps through the paged
forward, beside the machine's matrix-product peak in each dtype, all measured in one run.

    nice -n 19 python -m eval.bench_bf16 [--model smollm2] [--tokens 2048] [--decode-rows 1,16]
                                         [--dtypes float32,bfloat16] [--repeats 3]

For each dtype: the model loaded in it with packed linears (oneDNN; bfloat16 only where the CPU
has bfloat16 instructions), the KV pool in it; then

* ``peak``: oneDNN's packed linear on a [2048 x 2048] x [2048 x 2048] product, the rate the
  model's matrix products could reach at best here (GFLOP/s);
* ``prefill``: one paged forward of ``--tokens`` new tokens (logits of the last);
* ``decode B``: one paged decode step of B rows, each after the prefill's tokens as a shared
  segment (the RAG / shared system prompt case).

The dtypes' calls alternate, and each row is the fastest of ``--repeats`` calls (after one
warm-up): on a shared machine both dtypes see the same load, and the fastest call is the one least
disturbed by it. Per row: that time, its FLOPs (2 per weight of
every linear per token, the lm_head once per row that returns logits, attention's QK^T and PV),
GFLOP/s, the fraction of the same dtype's peak, and bfloat16's speed-up over float32. Writes
``bench_bf16.csv`` / ``.png`` to ``--out`` (default eval/results/).
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from .common import RESULTS, pyplot, save_figure, save_table


def interleaved(fns: dict, repeats: int) -> dict:
    """The fastest of ``repeats`` timed calls of each function (after one warm-up each), the
    functions called in turn: on a shared machine each sees the same load, and the fastest call is
    the one least disturbed by it."""
    best = dict.fromkeys(fns, float("inf"))
    for fn in fns.values():
        fn()
    for _ in range(repeats):
        for key, fn in fns.items():
            t = time.perf_counter()
            fn()
            best[key] = min(best[key], time.perf_counter() - t)
    return best


def linear_flops_per_token(model) -> tuple[int, int]:
    """(2 x weights of every linear but the lm_head, 2 x the lm_head's weights)."""
    import torch

    head = model.get_output_embeddings()
    body = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear) and m is not head)
    return 2 * body, 2 * head.weight.numel()


class Setup:
    """One dtype's model (packed linears), pool, and the steps timed: ``steps`` name -> (call, FLOPs, tokens)."""

    def __init__(self, args, dtype_name: str):
        import torch

        from promptcache import EngineConfig, PromptCache, RunnerConfig
        from promptcache.engine.serving_core.kvpool import KVPool
        from promptcache.engine.serving_core.paged import PagedRow, paged_forward
        from promptcache.models.loading import load_model
        from promptcache.models.packed import PackedLinear

        dtype = getattr(torch, dtype_name)
        model, tok = load_model(args.model, device="cpu", dtype=dtype_name)
        runner = PromptCache(model, tok, EngineConfig(runner=RunnerConfig(packed_linear=True))).runner
        cfg = model.config
        heads, head_dim = cfg.num_attention_heads, cfg.hidden_size // cfg.num_attention_heads
        body, head = linear_flops_per_token(model)
        attn = 2 * 2 * cfg.num_hidden_layers * heads * head_dim  # QK^T and PV per (query, key) pair
        n, m = args.tokens, PEAK_N
        g = torch.Generator().manual_seed(0)
        lin = PackedLinear(torch.randn(m, m, generator=g).to(dtype), None)
        x = torch.randn(m, m, generator=g).to(dtype)
        self.steps = {"peak": (lambda: lin(x), 2 * m ** 3, 0)}
        self.pool = pool = KVPool(runner.spec, "cpu", n + 16 * (sum(args.decode_rows) + 1), 16)
        vocab = model.get_input_embeddings().num_embeddings
        ids = ((torch.arange(n) * 7919 + 11) % vocab).tolist()
        blocks = pool.allocate(pool.blocks_for(n))
        prefill = [PagedRow(ids, list(range(n)), [], pool.slots(blocks, 0, n))]
        self.steps[f"prefill {n}"] = (lambda: paged_forward(runner, pool, prefill), n * body + head + attn * n * (n + 1) / 2, n)
        with torch.inference_mode():
            paged_forward(runner, pool, prefill)  # the prefix the decode rows read
        shared = [("prefix", pool.views(blocks, n)[0])]
        for b in args.decode_rows:
            rows = [PagedRow([ids[i % n]], [n], shared, pool.slots(pool.allocate(1), 0, 1)) for i in range(b)]
            self.steps[f"decode {b} x {n}"] = (lambda rows=rows: paged_forward(runner, pool, rows),
                                               b * (body + head + attn * (n + 1)), b)


PEAK_N = 2048  # the peak's product: [PEAK_N x PEAK_N] x [PEAK_N x PEAK_N]


def measure(args, dtypes: list[str]) -> list[dict]:
    import torch

    setups = {d: Setup(args, d) for d in dtypes}
    out = []
    with torch.inference_mode():
        for what in setups[dtypes[0]].steps:
            best = interleaved({d: s.steps[what][0] for d, s in setups.items()}, args.repeats)
            for d, s in setups.items():
                _, flops, tokens = s.steps[what]
                out.append(dict(dtype=d, what=what, ms=round(best[d] * 1e3, 2), tokens=tokens,
                                tok_s=round(tokens / best[d], 1), gflop_s=round(flops / best[d] / 1e9, 1)))
                print(json.dumps(out[-1]), flush=True)
    for r in out:
        peak = next(p for p in out if p["dtype"] == r["dtype"] and p["what"] == "peak")["gflop_s"]
        r["of_peak"] = round(r["gflop_s"] / peak, 3)
    return out


def plot(rows, path) -> None:
    plt = pyplot()
    if plt is None:
        return
    whats = [w for w in dict.fromkeys(r["what"] for r in rows) if w != "peak"]
    dtypes = list(dict.fromkeys(r["dtype"] for r in rows))
    fig, ax = plt.subplots(figsize=(2 + 1.6 * len(whats), 4))
    width = 0.8 / len(dtypes)
    for i, d in enumerate(dtypes):
        by = {r["what"]: r for r in rows if r["dtype"] == d}
        ax.bar([j + i * width for j in range(len(whats))], [by[w]["of_peak"] for w in whats], width, label=d)
    ax.set_xticks([j + width * (len(dtypes) - 1) / 2 for j in range(len(whats))], whats)
    ax.set_ylabel("fraction of the dtype's matmul peak")
    ax.set_title("paged forward vs oneDNN matmul peak, per dtype")
    ax.legend()
    save_figure(fig, path)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--decode-rows", type=lambda s: [int(x) for x in s.split(",")], default=[1, 16])
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default=str(RESULTS))
    args = ap.parse_args(argv)
    from promptcache.models.native_dtype import bf16_refusal

    why = bf16_refusal("cpu")
    print(f"bfloat16 on this CPU: {'native' if why is None else why}", flush=True)
    rows = measure(args, args.dtypes.split(","))
    base = {r["what"]: r for r in rows if r["dtype"] == "float32"}
    for r in rows:
        r["vs_float32"] = round(base[r["what"]]["ms"] / r["ms"], 2) if r["what"] in base else None
    print(f"{'dtype':<10}{'what':<18}{'ms':>9}{'tok/s':>9}{'GFLOP/s':>9}{'of peak':>9}{'x fp32':>8}")
    for r in rows:
        print(f"{r['dtype']:<10}{r['what']:<18}{r['ms']:>9}{r['tok_s']:>9}{r['gflop_s']:>9}{r['of_peak']:>9}"
              f"{str(r['vs_float32']):>8}")
    save_table("bench_bf16", rows, args.out, plot)


if __name__ == "__main__":
    sys.exit(main())
