"""Pilot for ``qmatch``: does the question's best-matching note hold the answer, and in which order
should the rest of a recompute budget go?

    nice -n 19 python -m eval.note_order_pilot [--first 0] [--samples 24] [--shuffle]

Reference implementation (``recompute_reference.py``, teacher-forced answer, as ``selection_study``)
on the retrieval task. Per question: full prefill and naive reuse; the notes ranked by
``promptcache.engine.prefill.recompute.match_scores`` (BM25 idf of the question's token ids over the
prompt's own notes); then whole notes recomputed in three orders after the best note: ``later``
(the engine's ``match_order``: by score, ties later note first), ``next`` (the notes after the best
one, then those before it) and ``prev`` (the notes before it, nearest first, then those after), at
r = 0.15 / 0.3 / 0.5; and ``tail_from_best`` (the best note and every note after it, whatever its
size). Writes ``note_order_pilot.csv`` (one row per question) to ``--out``.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from .common import RESULTS, write_csv
from .data.make_synthetic import retrieval_samples
from .metrics import kl_divergence
from .recompute_reference import blend, independent_kv
from .selection_study import build_prompt, correct
from .selections import whole_notes, request

from promptcache.engine.prefill.recompute import match_order

FRACTIONS = (0.15, 0.3, 0.5)


def orders(best: int, ranked: list[int], m: int) -> dict[str, list[int]]:
    return {"later": ranked,
            "next": [best, *range(best + 1, m), *range(best - 1, -1, -1)],
            "prev": [best, *range(best - 1, -1, -1), *range(best + 1, m)]}


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--first", type=int, default=0)
    ap.add_argument("--samples", type=int, default=24)
    ap.add_argument("--shuffle", action="store_true")
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    from promptcache.models.smollm2 import ensure_smollm2
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = ensure_smollm2()
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(path)
    gen, rows = torch.Generator().manual_seed(0), []
    for sample in retrieval_samples(args.first + args.samples, seed=11)[args.first:]:
        order = torch.randperm(len(sample["notes"]), generator=gen).tolist() if args.shuffle else None
        p, answer = build_prompt(tok, sample, order)
        base = independent_kv(model, p)
        full, _ = blend(model, p, base, p.candidates)
        c, m = p.candidates.numel(), len(p.modules)
        ranked = match_order(request(p))
        best = ranked[0]
        row = dict(sample=sample["_id"], target=p.target, best=best, full=correct(full, answer),
                   none=correct(blend(model, p, base, torch.empty(0, dtype=torch.long))[0], answer))
        for name, od in orders(best, ranked, m).items():
            for f in FRACTIONS:
                logits, _ = blend(model, p, base, whole_notes(p, od, round(f * c)))
                row[f"{name}@{f}"] = correct(logits, answer)
                row[f"{name}@{f}_kl"] = round(kl_divergence(full[1], logits[1]), 4)
        after = p.candidates[p.candidates >= p.modules[best][0]]
        row["tail_from_best"] = correct(blend(model, p, base, after)[0], answer)
        row["tail_from_best_fraction"] = round(after.numel() / c, 3)
        rows.append(row)
        print({k: v for k, v in row.items() if not k.endswith("_kl")}, flush=True)
        write_csv("note_order_pilot.csv", rows, args.out)
    n = len(rows)
    for k in [k for k in rows[0] if k not in ("sample", "target", "best") and not k.endswith(("_kl", "_fraction"))]:
        print(f"{k:16s} {sum(r[k] for r in rows)}/{n}")
    print(f"best-matching note holds the answer: {sum(r['best'] == r['target'] for r in rows)}/{n}")
    return rows


if __name__ == "__main__":
    main()
