"""Shipped examples on a real model: does the cached prompt give the same greedy text as full prefill?

    nice -n 19 python -m eval.examples_check [--model smollm2] [--max-new-tokens 32] [--recompute 0.3]

For every ``examples/*.xml`` prompt: its schema (``schemas/<name>.xml``, by the prompt's
``schema`` attribute) is added to one engine, then the prompt is generated greedily with the cache
(``pc.generate``, at the engine's default ``recompute="auto"``: the row ``auto``) and without
(``use_cache=False``: the same tokens, one plain prefill), and with each ``--recompute`` fraction
(``--recompute 0``: the paper's splice, the default before ``auto``). Per example: whether the
texts are identical, token agreement (common prefix / longer output), first-token KL(full ||
cached), whether the cached state was exact, how many tokens were recomputed. Writes ``examples_check.csv`` to ``--out``.
"""

from __future__ import annotations

import argparse
import xml.etree.ElementTree as ET
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
from .common import RESULTS, write_csv
from .metrics import kl_divergence, token_agreement

from promptcache import PromptCache


def examples(folder: Path) -> list[tuple[Path, str]]:
    """(prompt file, schema name) for every example prompt, sorted by file name."""
    out = []
    for path in sorted(folder.glob("*.xml")):
        root = ET.parse(path).getroot()
        if root.tag == "prompt":
            out.append((path, root.get("schema")))
    return out


def check(pc, prompt: Path, max_new_tokens: int, recompute: list[float]) -> list[dict]:
    full = pc.generate(prompt, max_new_tokens=max_new_tokens, use_cache=False)
    full_logits = pc.prefill_baseline(prompt).logits
    rows = []
    for r in [None, *recompute]:
        kw = {} if r is None else {"recompute": r}
        res = pc.prefill(prompt, **kw)
        gen = pc.generate(prompt, max_new_tokens=max_new_tokens, **kw)
        rows.append(dict(example=prompt.name, recompute="auto" if r is None else r, cached_tokens=res.cached_tokens,
                         new_tokens=res.new_tokens, recomputed_tokens=res.recomputed_tokens,
                         exact_state=int(bool(res.exact)),
                         same_text=int(gen.token_ids == full.token_ids),
                         token_agreement=round(token_agreement(full.token_ids, gen.token_ids), 4),
                         first_token_kl=kl_divergence(full_logits, res.logits),
                         output_full=full.text[:80], output_pc=gen.text[:80]))
    return rows


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--recompute", type=float, nargs="*", default=[], help="also these recompute fractions")
    ap.add_argument("--examples", type=Path, default=ROOT / "examples")
    ap.add_argument("--schemas", type=Path, default=ROOT / "schemas")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    torch.set_num_threads(args.threads)
    pc = PromptCache.from_pretrained(args.model)
    added, rows = set(), []
    for prompt, schema in examples(args.examples):
        if schema not in added:
            pc.add_schema(args.schemas / f"{schema}.xml")
            added.add(schema)
        for row in check(pc, prompt, args.max_new_tokens, args.recompute):
            rows.append(row)
            print(f"{row['example']:32s} r={row['recompute']} same={row['same_text']} "
                  f"agree={row['token_agreement']:.2f} kl={row['first_token_kl']:.3f} exact={row['exact_state']}",
                  flush=True)
    for r in sorted({row["recompute"] for row in rows}, key=str):
        rs = [row for row in rows if row["recompute"] == r]
        print(f"recompute {r}: {sum(x['same_text'] for x in rs)} of {len(rs)} examples give full prefill's text")
    print("wrote", write_csv("examples_check.csv", rows, args.out))
    return rows


if __name__ == "__main__":
    main()
