"""The same Python, slower after a large CPU kernel: why the attention op's own Python grows with B.

A compiled decode step's attention op (native kernel off) runs the same ~14 tensor calls a layer
whatever the batch, yet its own Python (the time between its calls, eval/host_overhead.py's
``attention_py_ms``) is ~4x longer at B = 48 than at B = 1. On the CPU each of its kernels streams
a B = 48 layer's gathered keys and values (tens of MB) through the core's caches, evicting the
interpreter's own code and objects; the next few Python calls then miss. This times a fixed run
of the attention op's metadata calls (views, a permute, transposes, a reshape: no kernel) right
after a copy of as many bytes as one layer's gather at batch B (``2 Hk B W D`` float32), and
after nothing. On a GPU the kernels stream the device's memory, not the host's caches.

    nice -n 10 python -m eval.host_caches            # eval/figures/host_caches.{csv,png}
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

from eval.common import save_table

FIGURES = Path(__file__).resolve().parent / "figures"


def metadata_calls(x) -> None:
    """The attention op's calls that launch no kernel (as attend_dense and the op make them)."""
    hk, b, w, d = x.shape
    x.view(hk, b * w, d)
    x.unbind(0)
    x.permute(1, 0, 2, 3)
    x.transpose(0, 1).transpose(0, 1)
    x[..., : d // 2]
    x[..., d // 2:]
    x.unsqueeze(0).reshape(hk, b, w, d)


def measure(args) -> list[dict]:
    import torch

    torch.set_num_threads(1)
    out = []
    x = torch.zeros(args.kv_heads, 1, args.width, args.head_dim)
    for batch in args.batches:
        n = 2 * args.kv_heads * batch * args.width * args.head_dim  # floats one layer gathers
        src, dst = torch.randn(n), torch.empty(n)
        times = {True: [], False: []}
        for _ in range(args.repeats):  # interleaved: both settings under the same load
            for streamed in (True, False):
                if streamed:
                    dst.copy_(src)
                t0 = time.perf_counter()
                metadata_calls(x)
                times[streamed].append((time.perf_counter() - t0) * 1e6)
        for streamed in (True, False):
            out.append(dict(batch=batch, streamed_mb=round(n * 4 / 2**20, 2) if streamed else 0.0,
                            python_us=round(statistics.median(times[streamed]), 2),
                            python_least_us=round(min(times[streamed]), 2)))
            print(out[-1])
    return out


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    batches = sorted({r["batch"] for r in rows})
    for streamed, label in ((True, "after a copy of a layer's gather"), (False, "after nothing")):
        ys = [next(r["python_us"] for r in rows if r["batch"] == b and (r["streamed_mb"] > 0) == streamed)
              for b in batches]
        ax.plot(batches, ys, marker="o", label=label)
    ax.set_xlabel("batch (rows) whose gather was copied")
    ax.set_ylabel("the same Python calls, us (median)")
    ax.set_ylim(bottom=0)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", default="1,16,48")
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--head-dim", type=int, default=32)
    ap.add_argument("--width", type=int, default=309, help="keys a row (eval/host_overhead.py's decode rows)")
    ap.add_argument("--repeats", type=int, default=300)
    ap.add_argument("--out", default=str(FIGURES))
    args = ap.parse_args(argv)
    args.batches = [int(b) for b in args.batches.split(",")]
    save_table("host_caches", measure(args), args.out, plot)


if __name__ == "__main__":
    main()
