"""How sure is a "kept share"? Paired statistics of an accuracy study's per-sample CSVs.

    python -m eval.kept_share eval/figures/accuracy_retrieval_issue36.csv more.csv ... \\
        [--method auto] [--full-vs OTHER.csv] [--bar 0.98] [--out eval/figures --tag _retrieval]

``eval/accuracy.py`` writes one row per (sample, mode, shuffled, recompute) with ``full_correct``
(full prefill's answer scored) and ``pc_correct`` (the cached method's). The issue-level figure
is the kept share, sum(pc_correct) / sum(full_correct). On a small model and a few dozen samples
that ratio moves by several points per answer, so this prints, per method and order:

* the kept share and a 95% paired bootstrap interval (samples resampled with both answers);
* the discordant pairs: b answers full prefill got and the method lost, c the reverse, and the
  exact two-sided McNemar p-value of b against c (is the loss real, or the noise of two
  readings of a near-chance task?);
* how often a method that loses nothing (its answers exchangeable with full prefill's: the same
  discordance, split evenly) would itself read below ``--bar`` on this many samples.

``--full-vs OTHER.csv`` reads full prefill's answers of the same prompts run another way (for
example in bfloat16) as one more method: how far a change that is not reuse moves the answers.

Rows of several CSVs are pooled (samples deduplicated by name: a later file's row wins), so
runs split with ``--first`` combine.
"""

from __future__ import annotations

import argparse
import csv
import math
import random
from pathlib import Path

from .common import pyplot, save_figure, save_table


def load(paths: list[Path], method: str | None) -> dict[tuple[str, int], tuple[int, int]]:
    """(sample, shuffled) -> (full_correct, pc_correct) of rows whose ``recompute`` is ``method``;
    ``method`` None: (full_correct, full_correct) of every sample (full prefill's answers, once)."""
    rows: dict[tuple[str, int], tuple[int, int]] = {}
    for path in paths:
        with open(path, newline="") as f:
            for i, r in enumerate(csv.DictReader(f), start=2):
                try:
                    if method is not None and r["recompute"] != method:
                        continue
                    full = int(r["full_correct"])
                    rows[(r["sample"], int(r["shuffled"]))] = (full, full if method is None else int(r["pc_correct"]))
                except (KeyError, ValueError) as e:
                    raise SystemExit(f"{path}:{i}: not an eval/accuracy.py per-sample row ({e})") from None
    return rows


def full_against(paths: list[Path], other: Path) -> dict[tuple[str, int], tuple[int, int]]:
    """(sample, shuffled) -> (full prefill's answer in ``paths``, full prefill's answer in ``other``)
    for the samples both hold: a change that is not reuse (another dtype, device or library
    version) read as if it were a method."""
    mine, theirs = load(paths, None), load([other], None)
    both = {k: (mine[k][0], theirs[k][0]) for k in mine if k in theirs}
    if not both:
        raise SystemExit(f"{other} shares no (sample, shuffled) with {', '.join(map(str, paths))}")
    return both


def mcnemar_p(b: int, c: int) -> float:
    """Exact two-sided McNemar p-value: b of b + c discordant pairs under a fair coin."""
    n = b + c
    if n == 0:
        return 1.0
    tail = sum(math.comb(n, k) for k in range(min(b, c) + 1)) / 2 ** n
    return min(1.0, 2 * tail)


def bootstrap_ci(pairs: list[tuple[int, int]], reps: int = 10000, seed: int = 0) -> tuple[float, float]:
    """95% percentile interval of sum(pc) / sum(full) over samples drawn with replacement."""
    rng, n, ratios = random.Random(seed), len(pairs), []
    for _ in range(reps):
        draw = [pairs[rng.randrange(n)] for _ in range(n)]
        full = sum(f for f, _ in draw)
        if full:
            ratios.append(sum(p for _, p in draw) / full)
    ratios.sort()
    return ratios[int(0.025 * len(ratios))], ratios[int(0.975 * len(ratios)) - 1]


def chance_below(pairs: list[tuple[int, int]], bar: float, reps: int = 10000, seed: int = 1) -> float:
    """How often a method whose answers are exchangeable with full prefill's (each discordant
    pair lost or won with probability 1/2, the same number of discordant pairs) reads below
    ``bar``: the share of honest, lossless methods the bar would fail on this sample."""
    full = sum(f for f, _ in pairs)
    discordant = sum(f != p for f, p in pairs)
    if not full:
        return float("nan")
    rng, below = random.Random(seed), 0
    for _ in range(reps):
        lost = sum(rng.random() < 0.5 for _ in range(discordant))
        below += (full - lost + (discordant - lost)) / full < bar
    return below / reps


def summarize(pairs: list[tuple[int, int]], bar: float) -> dict:
    full, pc = sum(f for f, _ in pairs), sum(p for _, p in pairs)
    b = sum(f and not p for f, p in pairs)
    c = sum(p and not f for f, p in pairs)
    lo, hi = bootstrap_ci(pairs)
    return dict(samples=len(pairs), full_correct=full, method_correct=pc, kept=round(pc / full, 3) if full else None,
                ci_low=round(lo, 3), ci_high=round(hi, 3), lost_b=b, won_c=c, mcnemar_p=round(mcnemar_p(b, c), 4),
                lossless_below_bar=round(chance_below(pairs, bar), 3))


def plot(rows: list[dict], path: Path) -> None:
    plt = pyplot()
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(1.4 * len(rows) + 2, 4))
    labels = [f"{r['method']}\n{r['order']}" for r in rows]
    kept = [r["kept"] or 0 for r in rows]
    err = [[k - r["ci_low"] for k, r in zip(kept, rows)], [r["ci_high"] - k for k, r in zip(kept, rows)]]
    ax.bar(labels, kept, yerr=err, capsize=4, color="C0")
    ax.axhline(rows[0]["bar"], color="C3", linestyle="--", label=f"bar {rows[0]['bar']:.0%}")
    ax.set_ylabel("kept share of full prefill's answers (95% CI)")
    ax.legend()
    save_figure(fig, path)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("csv", nargs="+", type=Path, help="eval/accuracy.py per-sample CSVs (not *_summary.csv)")
    ap.add_argument("--method", nargs="+", default=["auto"], help="values of the rows' recompute column")
    ap.add_argument("--full-vs", type=Path, metavar="CSV",
                    help="also read full prefill's answers in CSV (the same prompts run another way: another dtype "
                         "or device) as a method against the first files' full prefill")
    ap.add_argument("--bar", type=float, default=0.98, help="the kept share a method must reach")
    ap.add_argument("--out", type=Path, help="write kept_share{tag}.csv and .png here")
    ap.add_argument("--tag", default="")
    args = ap.parse_args(argv)
    rows = []
    sources = [(method, load(args.csv, method)) for method in args.method]
    if args.full_vs:
        sources.append((f"full:{args.full_vs.stem}", full_against(args.csv, args.full_vs)))
    for method, found in sources:
        if not found:
            raise SystemExit(f"no rows with recompute={method!r} in {', '.join(map(str, args.csv))}")
        for order, shuffled in (("in order", 0), ("shuffled", 1), ("both", None)):
            pairs = [v for (_, s), v in sorted(found.items()) if shuffled is None or s == shuffled]
            if pairs:
                rows.append(dict(method=method, order=order, bar=args.bar, **summarize(pairs, args.bar)))
    for r in rows:
        print(f"{r['method']:>16s} {r['order']:>9s}  n={r['samples']:3d}  full {r['full_correct']:3d}  "
              f"method {r['method_correct']:3d}  kept {r['kept']:.3f} [{r['ci_low']:.3f}, {r['ci_high']:.3f}]  "
              f"lost {r['lost_b']:2d} won {r['won_c']:2d}  McNemar p {r['mcnemar_p']:.3f}  "
              f"a lossless method reads < {args.bar:.0%}: {r['lossless_below_bar']:.0%}")
    if args.out:
        save_table(f"kept_share{args.tag}", rows, args.out, plot)


if __name__ == "__main__":
    main()
