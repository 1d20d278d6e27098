"""Two fidelity methods on the same prompts, paired: does one agree with full prefill more often?

    python -m eval.fidelity_paired A.csv [B.csv ...] --methods alone:default default --budget 0.15

Reads ``eval/fidelity.py``'s per-prompt CSVs (``fidelity{tag}.csv``, not the summaries) and, per
task, pairs the two methods' rows of the same prompt (sample and order) at ``--budget``: agreement
with full prefill's answer of each, how many prompts both agree on, only the first, only the
second, and McNemar's exact p of the discordant pairs (``kept_share.mcnemar_p``). Prompts one
method lacks are left out (``prompts`` counts the pairs). Prints a Markdown table; ``--out`` also
writes it as CSV.
"""

from __future__ import annotations

import argparse
import csv
from pathlib import Path

from . import kept_share
from .common import write_csv


def pairs(rows: list[dict], a: str, b: str, budget: float) -> dict[str, list[tuple[int, int]]]:
    """task -> [(a agrees, b agrees)] over the prompts (sample, order) both methods ran at ``budget``."""
    got: dict[tuple[str, str, str], dict[str, int]] = {}
    for r in rows:
        if r["method"] in (a, b) and abs(float(r["budget"]) - budget) < 1e-9:
            got.setdefault((r["task"], r["sample"], r["order"]), {})[r["method"]] = int(r["agree"])
    out: dict[str, list[tuple[int, int]]] = {}
    for (task, _, _), m in sorted(got.items()):
        if a in m and b in m:
            out.setdefault(task, []).append((m[a], m[b]))
    return out


def table(rows: list[dict], a: str, b: str, budget: float) -> list[dict]:
    out = []
    for task, ps in pairs(rows, a, b, budget).items():
        n, only_a, only_b = len(ps), sum(x > y for x, y in ps), sum(y > x for x, y in ps)
        out.append(dict(task=task, budget=budget, prompts=n, a=a, b=b,
                        agreement_a=round(sum(x for x, _ in ps) / n, 4), agreement_b=round(sum(y for _, y in ps) / n, 4),
                        both=sum(x and y for x, y in ps), only_a=only_a, only_b=only_b,
                        mcnemar_p=round(kept_share.mcnemar_p(only_a, only_b), 4)))
    return out


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("csv", nargs="+", type=Path, help="eval/fidelity.py per-prompt CSVs")
    ap.add_argument("--methods", nargs=2, required=True, metavar=("A", "B"))
    ap.add_argument("--budget", type=float, required=True)
    ap.add_argument("--out", type=Path, help="write this CSV")
    args = ap.parse_args(argv)
    rows = []
    for path in args.csv:
        with open(path, newline="") as f:
            rows += list(csv.DictReader(f))
    a, b = args.methods
    out = table(rows, a, b, args.budget)
    if not out:
        raise SystemExit(f"no prompt has rows of both {a} and {b} at budget {args.budget}")
    print(f"| task | prompts | {a} | {b} | both / {a} only / {b} only | McNemar p |\n| --- | --- | --- | --- | --- | --- |")
    for r in out:
        print(f"| {r['task']} | {r['prompts']} | {r['agreement_a']:.2f} | {r['agreement_b']:.2f} | "
              f"{r['both']} / {r['only_a']} / {r['only_b']} | {r['mcnemar_p']:.3g} |")
    if args.out:
        write_csv(args.out.name, out, args.out.parent)
    return out


if __name__ == "__main__":
    main()
