"""Shared helpers for the benchmarks: deterministic text, timing, CSV output."""

from __future__ import annotations

import csv
import random
import statistics
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"

WORDS = (
    "the city river museum market train temple garden bridge harbour castle street night food music "
    "ancient modern quiet busy famous small large old new north south east west travel visit walk see "
    "history art coffee bread tea fish rice noodle wine cheese park square tower church palace island "
    "mountain valley lake beach forest village road station ticket hotel room morning evening summer"
).split()


def sentences(n_words: int, seed: int) -> str:
    rng = random.Random(seed)
    out, words = [], 0
    while words < n_words:
        k = rng.randint(6, 14)
        s = " ".join(rng.choice(WORDS) for _ in range(k))
        out.append(s[0].upper() + s[1:] + ".")
        words += k
    return " ".join(out)


def median_time(fn, repeats: int, warmup: int = 1) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def write_csv(name: str, rows: list[dict]) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / name
    tmp = path.with_suffix(path.suffix + ".tmp")
    with tmp.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    tmp.replace(path)
    return path
