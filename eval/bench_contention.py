"""How much a little CPU load elsewhere slows the engine's steps on a small machine.

The served figures of ``eval/serve_peer.py`` run the load generator (the ``openai`` client's
streaming threads) on the same cores as the server's compute threads. This measures what that
costs, in process and without a server: a decode step of B rows behind a shared 1K prompt
(SmolLM2-135M-Instruct, float32, packed linears, the native attention kernel), timed while
another process keeps one core busy for a fraction ``duty`` of every 10 ms (0 = nothing else
running). The compute threads meet at a barrier after every operation, so a thread that loses
its core for a moment holds the other one too: the step slows by more than the CPU share taken.

    python -m eval.bench_contention            # ~2 min; prints the table, writes contention.csv/.png

Duties are measured in rounds (each round every duty once, each one ``--steps`` steps), so a
drift of the machine's speed hits them alike; the table gives each duty's median step and its
ratio to the unloaded one.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from promptcache.bench import load_avg

from .common import RESULTS, pyplot, save_table

# a process that spins for ``duty`` of every 10 ms and sleeps the rest, until killed
_HOG = """
import sys, time
duty = float(sys.argv[1])
while True:
    t = time.perf_counter()
    while time.perf_counter() - t < duty * 0.01:
        pass
    time.sleep(0.01 * (1 - duty))
"""


def decode_step(rows: int, shared: int):
    """A function running one decode step of ``rows`` rows behind a ``shared``-token prompt."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from promptcache.kernels import attention as cpu_attention
    from promptcache.engine.serving_core.kvpool import KVPool
    from promptcache.engine.serving_core.paged import PagedRow, paged_forward
    from promptcache.engine.prefill.runner import ModelRunner
    from promptcache.models.packed import pack_linears
    from promptcache.models.smollm2 import ensure_smollm2

    if not cpu_attention.available():
        raise SystemExit(f"the native kernel is not available: {cpu_attention.unavailable_reason()}")
    folder = ensure_smollm2()
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    pack_linears(model)
    runner = ModelRunner(model, AutoTokenizer.from_pretrained(folder))
    pool = KVPool(runner.spec, runner.device, tokens=shared + 64 * rows, block_size=16)
    blocks = pool.allocate(shared // 16)
    ids = torch.randint(0, 49000, (shared,), generator=torch.Generator().manual_seed(0)).tolist()
    paged_forward(runner, pool, [PagedRow(ids, list(range(shared)), [], pool.slots(blocks, 0, shared), logits=False)])
    seg = [("shared", pool.views(blocks, shared)[0])]
    own = [pool.slots(pool.allocate(3), 0, 40) for _ in range(rows)]  # 40 own tokens each
    batch = [PagedRow([5], [shared + 40], seg, o) for o in own]
    return lambda: paged_forward(runner, pool, batch)


def timed(step, n: int) -> list[float]:
    out = []
    for _ in range(n):
        t = time.perf_counter()
        step()
        out.append(time.perf_counter() - t)
    return out


def measure(args) -> list[dict]:
    rows = []
    for b in args.rows:
        step = decode_step(b, args.shared)
        timed(step, 3)  # warm
        times: dict[float, list[float]] = {d: [] for d in args.duties}
        for _ in range(args.rounds):
            for duty in args.duties:
                hog = subprocess.Popen([sys.executable, "-c", _HOG, str(duty)]) if duty > 0 else None
                try:
                    time.sleep(0.05)
                    times[duty] += timed(step, args.steps)
                finally:
                    if hog is not None:
                        hog.kill()
                        hog.wait()
        base = statistics.median(times[args.duties[0]])
        for duty in args.duties:
            ms = statistics.median(times[duty])
            share = duty / torch.get_num_threads()  # of the compute threads' cores
            rows.append({"rows": b, "shared_tokens": args.shared, "duty": duty, "cores_taken": round(share, 3),
                         "step_ms": round(1000 * ms, 2), "slowdown": round(ms / base, 3),
                         "threads": torch.get_num_threads(), "load1": load_avg()})
    return rows


def plot(rows: list[dict], path: Path) -> None:
    plt = pyplot()
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(6, 4))
    for b in sorted({r["rows"] for r in rows}):
        rs = [r for r in rows if r["rows"] == b]
        ax.plot([100 * r["cores_taken"] for r in rs], [r["slowdown"] for r in rs], "o-", label=f"{b} decode rows")
    xs = [100 * r["cores_taken"] for r in rows]
    ax.plot([0, max(xs)], [1, 1 + max(xs) / 100], "k--", lw=1, label="slowdown = CPU share taken")
    ax.set_xlabel("CPU taken by another process (% of the compute threads' cores)")
    ax.set_ylabel("decode step time / unloaded")
    ax.set_title(f"SmolLM2 decode step under outside load, {rows[0]['threads']} threads")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    floats = lambda s: [float(x) for x in s.split(",")]  # noqa: E731
    ap.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    ap.add_argument("--rows", type=lambda s: [int(x) for x in s.split(",")], default=[16, 64],
                    help="decode rows per step")
    ap.add_argument("--shared", type=int, default=1024, help="shared prompt tokens (a multiple of 16)")
    ap.add_argument("--duties", type=floats, default=[0.0, 0.05, 0.1, 0.2],
                    help="fractions of one core the other process takes; the first is the baseline")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=8, help="timed steps per duty and round")
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args(argv)
    if args.shared % 16 or args.duties[0] != 0.0:
        ap.error("--shared must be a multiple of 16 and the first duty 0")
    torch.set_num_threads(args.threads)
    rows = measure(args)
    print(f"{'rows':>5s} {'CPU taken':>10s} {'step ms':>8s} {'slowdown':>9s}")
    for r in rows:
        print(f"{r['rows']:5d} {100 * r['cores_taken']:9.1f}% {r['step_ms']:8.1f} {r['slowdown']:8.3f}x")
    save_table("contention", rows, args.out, plot)
    return rows


if __name__ == "__main__":
    main()
