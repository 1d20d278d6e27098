"""The native CPU attention kernel against torch's, on the shapes the paged engine runs.

Every cell is one attention call of one layer, SmolLM2-135M's heads (3 key/value heads, 3 query
heads each, head dim 64, float32), timed round-robin against what the engine called before the
kernel existed, in one process:

- ``attend``: torch's fused CPU kernel (``_scaled_dot_product_flash_attention_for_cpu``, which
  returns the log-sum-exp the engine merges with) on the same q, k, v;
- ``attend_gather`` (decode rows over their own keys, read by pool slot): the gather
  (``index_select`` of each row's slots, padded) and one masked matrix-product attention, as the
  engine did from 8 rows on.

    python -m eval.bench_attention                 # ~1 min; --threads 2 as the serving figures

Prints a table (milliseconds, GFLOP/s, torch / native), writes attention.csv and attention.png
(``--out``).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from promptcache.bench import load_avg, round_robin
from promptcache.kernels import attention as cpu_attention

from .common import RESULTS, pyplot, save_table

HK, G, D = 3, 3, 64  # SmolLM2-135M: key/value heads, query heads per key/value head, head dim
OWN = 40  # own keys of each decode row (its prompt's last part and generated tokens)
_FLASH = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def cells() -> list[tuple[str, int, int, int]]:
    """(what, query rows per head, keys, causal_t)."""
    out = [(f"{b} decode rows x {n // 1024}K shared prompt", b * G, n, 0) for b in (1, 16, 64) for n in (1024, 4096)]
    out += [("25 new tokens x 2K cached prompt", 25 * G, 2048, 0),
            ("512-token chunk x 1536 earlier tokens", 512 * G, 1536, 0),
            ("512-token chunk among itself (causal)", 512 * G, 512, 512)]
    return out


def torch_fused(q, k, v, scale, causal_t):
    if causal_t:
        t = causal_t
        q4 = q.view(HK, -1, t, D)
        kx, vx = (x[:, None].expand(HK, q4.shape[1], t, D) for x in (k, v))
        return _FLASH(q4, kx, vx, 0.0, True, scale=scale)[:2]
    return _FLASH(q[:, None], k[:, None], v[:, None], 0.0, False, scale=scale)[:2]


def torch_gather(q, kbuf, vbuf, slots, bias, scale):
    """q [HK, B, G, D]: index_select of every row's slots, one masked attention by matrix products."""
    b, width = slots.shape
    flat = slots.view(-1)
    ks = kbuf.index_select(1, flat).view(HK * b, width, D)
    vs = vbuf.index_select(1, flat).view(HK * b, width, D)
    s = torch.baddbmm(bias, q.view(HK * b, G, D), ks.transpose(-1, -2), alpha=scale)
    top = s.amax(-1, keepdim=True)
    p = torch.exp(s - top)
    total = p.sum(-1, keepdim=True)
    return (p @ vs) / total, (top + total.log()).squeeze(-1)


def measure(args) -> list[dict]:
    torch.manual_seed(0)
    attend = cpu_attention.kernel_for(torch.zeros(1, 1, D))
    gather = cpu_attention.gather_kernel_for(torch.zeros(1, 1, 1, D), torch.zeros(1))
    if attend is None or gather is None:
        raise SystemExit(f"the native kernel is not available: {cpu_attention.unavailable_reason()}")
    rows, scale = [], D ** -0.5
    for what, m, n, causal_t in cells():
        q, k, v = torch.randn(HK, m, D), torch.randn(HK, n, D), torch.randn(HK, n, D)
        t = round_robin({"native": lambda: attend(q, k, v, scale, causal_t),
                         "torch": lambda: torch_fused(q, k, v, scale, causal_t)}, args.rounds)
        flops = 4 * HK * m * n * D / (2 if causal_t else 1)
        rows.append(_row(what, "attend", t, flops))
    for b in (1, 16, 64):
        buf = torch.randn(2, HK, 8192, D)  # one layer of a pool
        slots = torch.stack([torch.randperm(8192)[:OWN] for _ in range(b)])
        lengths = torch.full((b,), OWN, dtype=torch.long)
        bias = torch.zeros(HK * b, 1, OWN)
        q = torch.randn(HK, b, G, D)
        t = round_robin({"native": lambda: gather(q, buf[0], buf[1], slots, lengths, scale),
                         "torch": lambda: torch_gather(q, buf[0], buf[1], slots, bias, scale)}, args.rounds)
        rows.append(_row(f"{b} decode rows x {OWN} own keys (by slot)", "attend_gather", t, 4 * HK * b * G * OWN * D))
    return rows


def _row(what: str, op: str, t: dict[str, float], flops: float) -> dict:
    return {"cell": what, "op": op, "native_ms": round(1000 * t["native"], 4), "torch_ms": round(1000 * t["torch"], 4),
            "native_gflops": round(flops / t["native"] / 1e9, 1), "torch_gflops": round(flops / t["torch"] / 1e9, 1),
            "speedup": round(t["torch"] / t["native"], 2), "threads": torch.get_num_threads(), "load1": load_avg()}


def plot(rows: list[dict], path: Path) -> None:
    plt = pyplot()
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(9, 0.42 * len(rows) + 1.2))
    ys = range(len(rows))
    ax.barh(ys, [r["speedup"] for r in rows], color="#4c72b0")
    ax.axvline(1.0, color="gray", lw=1)
    ax.set_yticks(list(ys), [r["cell"] for r in rows], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("torch's time / the native kernel's (one layer's attention)")
    ax.set_title(f"Native CPU attention, SmolLM2 heads, float32, {rows[0]['threads']} threads")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    ap.add_argument("--rounds", type=int, default=30, help="timed calls of each method per cell (median)")
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    if _FLASH is None:
        raise SystemExit("this torch build has no fused CPU attention to compare with")
    rows = measure(args)
    print(f"{'cell':48s} {'op':14s} {'native ms':>10s} {'torch ms':>9s} {'GFLOP/s':>15s} {'speedup':>8s}")
    for r in rows:
        print(f"{r['cell']:48s} {r['op']:14s} {r['native_ms']:10.3f} {r['torch_ms']:9.3f} "
              f"{r['native_gflops']:7.0f} /{r['torch_gflops']:6.0f} {r['speedup']:7.2f}x")
    save_table("attention", rows, args.out, plot)
    return rows


if __name__ == "__main__":
    main()
