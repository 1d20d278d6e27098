"""OpenMP's wait policy beside a busy-looping process: DocumentStore.add() and a RAG loop, quiet
and contended, with the policy promptcache sets (PASSIVE) and libgomp's default (ACTIVE spin).

Each (policy, load) cell runs in a fresh process (libgomp reads its policy once, when torch
loads it): SmolLM2-135M-Instruct, float32, a warm-up ``add`` then ``--docs`` timed ``add()`` of
~300-token documents, then a RAG loop (``--questions`` questions over two documents each,
``--tokens`` generated greedily). "contended": another process spins on one core the whole time.
Cells run in rounds (every cell once per round), so a drift of the machine hits them alike;
medians are reported, and each contended time as a ratio to its policy's quiet one.

    python -m eval.bench_wait_policy              # ~4 min on 2 cores; writes wait_policy.csv/.png
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

from promptcache.bench import load_avg

from .common import RESULTS, pyplot, save_table

ROOT = Path(__file__).resolve().parents[1]
_HOG = "while True:\n    pass\n"  # one busy-looping thread, until killed

def child(docs: int, questions: int, tokens: int) -> dict:
    """Run in the measured process: seconds of ``docs`` add() calls and of the RAG loop."""
    import time

    import torch

    from promptcache.frontend.common import load_engine
    from promptcache.rag import DocumentStore

    pc = load_engine("smollm2", "cpu", "float32", None)
    store = DocumentStore(pc)
    text = ("The museum of {n} opens at nine, closes at six and keeps {n} rooms of tiles, maps and old "
            "instruments; guided visits leave every hour from the main hall. ") * 9
    store.add("warm", text.format(n="warm"))
    t = time.perf_counter()
    for i in range(docs):
        store.add(f"d{i}", text.format(n=i))
    add_s = time.perf_counter() - t
    t = time.perf_counter()
    for q in range(questions):
        store.generate(f"When does museum {q % docs} open?", [f"d{q % docs}", f"d{(q + 1) % docs}"],
                       max_new_tokens=tokens, temperature=0.0)
    rag_s = time.perf_counter() - t
    return {"add_s": add_s, "rag_s": rag_s, "threads": torch.get_num_threads()}


def cell(policy: str, contended: bool, args) -> dict:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_WAIT_POLICY": policy}
    env.pop("OMP_NUM_THREADS", None)  # torch's own count: one thread per core
    hog = subprocess.Popen([sys.executable, "-c", _HOG]) if contended else None
    try:
        out = subprocess.run([sys.executable, "-m", "eval.bench_wait_policy", "--child", str(args.docs),
                              str(args.questions), str(args.tokens)], env=env, cwd=ROOT, capture_output=True,
                             text=True, timeout=900, check=True).stdout
    finally:
        if hog is not None:
            hog.kill()
            hog.wait()
    return json.loads(out.strip().splitlines()[-1])


def measure(args) -> list[dict]:
    cells = [(p, c) for p in args.policies for c in (False, True)]
    got: dict = {k: [] for k in cells}
    for _ in range(args.rounds):
        for policy, contended in cells:
            got[(policy, contended)].append(cell(policy, contended, args))
            print(policy, "contended" if contended else "quiet", got[(policy, contended)][-1], flush=True)
    rows = []
    for policy, contended in cells:
        runs, quiet = got[(policy, contended)], got[(policy, False)]
        add = statistics.median(r["add_s"] for r in runs)
        rag = statistics.median(r["rag_s"] for r in runs)
        rows.append({"policy": policy, "load": "busy thread" if contended else "quiet", "docs": args.docs,
                     "add_s": round(add, 3), "add_ratio": round(add / statistics.median(r["add_s"] for r in quiet), 2),
                     "questions": args.questions, "rag_s": round(rag, 3),
                     "rag_ratio": round(rag / statistics.median(r["rag_s"] for r in quiet), 2),
                     "threads": runs[0]["threads"], "rounds": len(runs), "load1": load_avg()})
    return rows


def plot(rows: list[dict], path: Path) -> None:
    plt = pyplot()
    if plt is None:
        return
    fig, axes = plt.subplots(1, 2, figsize=(8, 3.5))
    for ax, what in zip(axes, ("add_s", "rag_s")):
        labels = [f"{r['policy']}\n{r['load']}" for r in rows]
        ax.bar(range(len(rows)), [r[what] for r in rows], color=["#8ab" if r["load"] == "quiet" else "#c86"
                                                                  for r in rows])
        ax.set_xticks(range(len(rows)), labels, fontsize=7)
        ax.set_ylabel("seconds")
        ax.set_title("add() x %d" % rows[0]["docs"] if what == "add_s" else "RAG loop, %d questions" % rows[0]["questions"])
    fig.suptitle("SmolLM2 on CPU beside one busy-looping process, by OpenMP wait policy", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> list[dict] | None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--child", nargs=3, type=int, metavar=("DOCS", "QUESTIONS", "TOKENS"), help=argparse.SUPPRESS)
    ap.add_argument("--policies", type=lambda s: s.split(","), default=["PASSIVE", "ACTIVE"])
    ap.add_argument("--docs", type=int, default=4, help="timed add() calls")
    ap.add_argument("--questions", type=int, default=4, help="questions of the RAG loop")
    ap.add_argument("--tokens", type=int, default=16, help="tokens generated per question")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args(argv)
    if args.child:
        print(json.dumps(child(*args.child)))
        return None
    rows = measure(args)
    print(f"{'policy':>8s} {'load':>12s} {'add s':>7s} {'x quiet':>7s} {'RAG s':>7s} {'x quiet':>7s}")
    for r in rows:
        print(f"{r['policy']:>8s} {r['load']:>12s} {r['add_s']:7.2f} {r['add_ratio']:7.2f} {r['rag_s']:7.2f} "
              f"{r['rag_ratio']:7.2f}")
    save_table("wait_policy", rows, args.out, plot)
    return rows


if __name__ == "__main__":
    main()
