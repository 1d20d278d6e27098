"""Shared helpers for the benchmarks: deterministic text, timing, CSV output, plotting, children.

Timing has one implementation, ``promptcache.bench.round_robin`` (one call of each method per
round, medians); ``interleaved_medians`` adds the studies' warm-up and time budget around it.
"""

from __future__ import annotations

import csv
import os
import sys
import time
from pathlib import Path

# one deterministic text generator and timer for the whole project (promptcache/bench.py)
from promptcache.bench import WORDS, median_time, round_robin, sentences  # noqa: F401 (WORDS, median_time: for the studies)

RESULTS = Path(__file__).resolve().parent / "results"
ROOT = Path(__file__).resolve().parents[1]  # the repository: ``eval`` is importable from here


def interleaved_medians(fns: dict, repeats: int, warmup: set | None = None, budget_s: float | None = None,
                        expected: dict | None = None) -> dict:
    """Median wall time of each function in ``fns`` (name -> fn), timed round-robin: one call of
    each per round, so load from other processes on a shared machine falls on all of them alike.
    Names in ``warmup`` get one untimed call first. With ``budget_s``, fewer rounds (at least one)
    are run when a round would take longer than ``budget_s / repeats``, judged by the warm-up
    times and ``expected`` (name -> seconds) for the others."""
    one = dict(expected or {})
    for name in warmup if warmup is not None else fns:
        t0 = time.perf_counter()
        fns[name]()
        one[name] = time.perf_counter() - t0
    round_s = sum(one.get(name, 0.0) for name in fns)
    if budget_s is not None and round_s > 0:
        repeats = max(1, min(repeats, int(budget_s / round_s)))
    return round_robin(fns, repeats)


def child_command(module: str, *args: str) -> tuple[list[str], dict]:
    """(command, environment) that runs ``python -m module args...`` as a child process from any
    working directory (the repository root goes first on its PYTHONPATH)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p))
    return [sys.executable, "-m", module, *args], env


def streamed_chat(oai, model: str, messages: list[dict], max_tokens: int):
    """One streamed greedy chat request through an OpenAI client ``oai``: (TTFT s, answer text,
    the final usage object: prompt, completion and cached tokens)."""
    t0, ttft, text, usage = time.perf_counter(), None, [], None
    for chunk in oai.chat.completions.create(model=model, messages=messages, max_tokens=max_tokens, temperature=0,
                                             stream=True, stream_options={"include_usage": True}):
        if ttft is None:
            ttft = time.perf_counter() - t0
        if chunk.choices:
            text.append(chunk.choices[0].delta.content or "")
        if chunk.usage is not None:
            usage = chunk.usage
    return ttft, "".join(text), usage


def text_of_tokens(tok, n: int, seed: int) -> str:
    """Deterministic prose of at most ``n`` tokens (as close to ``n`` as whole words allow)."""
    if n <= 0:
        return ""
    words = sentences(2 * n + 8, seed).split()
    count = lambda k: len(tok.encode(" ".join(words[:k]), add_special_tokens=False))  # noqa: E731
    lo, hi = 1, len(words)
    while count(hi) < n:  # a tokenizer with fewer than one token per word
        words += sentences(2 * n + 8, seed + hi).split()
        hi = len(words)
    while lo < hi:  # the largest k with count(k) <= n
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if count(mid) <= n else (lo, mid - 1)
    return " ".join(words[:lo])


def forget_placement(pc) -> None:
    """Make the next ``pc.prefill`` copy every stored module into its (reused) buffer, as for a
    prompt whose buffer last held other modules."""
    pc.forget_placement()


def write_csv(name: str, rows: list[dict], out: Path | str | None = None) -> Path:
    """Write ``rows`` to ``out/name`` (default eval/results/) atomically."""
    folder = Path(out) if out is not None else RESULTS
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / name
    tmp = path.with_suffix(path.suffix + ".tmp")
    with tmp.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    tmp.replace(path)
    return path


def save_table(stem: str, rows: list[dict], out: Path | str | None, plot) -> None:
    """``rows`` to ``out/stem.csv`` (``write_csv``) and ``plot(rows, out/stem.png)``; says where, and
    the load average at the end (a figure taken under load is no figure)."""
    from promptcache.bench import load_avg

    path = write_csv(f"{stem}.csv", rows, out)
    plot(rows, path.with_suffix(".png"))
    print(f"wrote {path} and {stem}.png (load {load_avg()})")


def add_model_args(ap, model: str = "embedded:bench") -> None:
    """--model / --device / --dtype, the same in every study and benchmark."""
    import torch

    ap.add_argument("--model", default=model, help="Hugging Face id, local directory, or embedded[:bench]")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="float32", help="float32, bfloat16 or float16")


def pyplot():
    """matplotlib's pyplot on the Agg backend, or None (with a note) when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("note: matplotlib is not installed (pip install matplotlib): no PNG written")
        return None
    return plt


def save_figure(fig, path) -> None:
    """Lay out, write (110 dpi) and close a figure (made after ``pyplot()``): the end of a benchmark's plot."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
