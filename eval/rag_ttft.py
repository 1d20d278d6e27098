"""TTFT of one RAG prompt: the default DocumentStore mode against full prefill (issue 36).

    nice -n 19 python -m eval.rag_ttft --model smollm2 [--docs 4] [--doc-tokens 240] [--repeats 5]

``--docs`` documents of about ``--doc-tokens`` tokens (deterministic prose), added to a
``DocumentStore(pc)`` (the default mode: each encoded at ``add``), then one question over all of
them in a random order per round (any order is reused). Timed round-robin in one process, each
round: full prefill of the prompt's tokens (``prefill_plain``, no cache), the default mode
(``"auto"``: 15% of the documents' tokens recomputed, the named document first), the default at
``recompute=0`` (the paper's splice: the limit of reuse) and an exact store on a chain it has
not stored (its first request: a plain prefill plus storing the links); ``--budgets R ...`` adds
the default's selection at other fractions (``default@R``), ``--selections NAME@R ...`` another
engine selection (a store with ``selection=NAME``; ``NAME@auto`` at the default budget). Reports the median TTFT
of each and full prefill's median over it (one run's ratios); writes ``rag_ttft{--tag}.csv``
and a PNG to ``--out`` (default eval/results/).
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch

from . import engine_selections  # noqa: F401  (registers the studies' engine selections for --selections)
from .common import RESULTS, add_model_args, pyplot, save_table, text_of_tokens

from promptcache import PromptCache
from promptcache.rag import DocumentStore

SYSTEM = "Answer the question from the documents only."


def run(args) -> list[dict]:
    torch.set_num_threads(max(1, min(args.threads, torch.get_num_threads())))
    pc = PromptCache.from_pretrained(args.model, device=args.device, dtype=args.dtype)
    texts = {f"d{i}": text_of_tokens(pc.tokenizer, args.doc_tokens, seed=i) for i in range(args.docs)}
    store = DocumentStore(pc, namespace="default")
    for d, t in texts.items():
        store.add(d, t)
    rng, times, info = random.Random(0), {}, {}
    others = {label: DocumentStore(pc, namespace="default", selection=label.partition("@")[0])
              for label in args.selections}  # the same stored states, another selection
    for other in others.values():
        for d, t in texts.items():
            other.add(d, t)  # stored already under the same namespace: nothing is encoded again
    methods = ("full_prefill", "default", *(f"default@{r}" for r in args.budgets), *others, "default_r0",
               "exact_first_request")
    for rnd in range(args.repeats + 1):  # round 0 warms up (not kept)
        ids = list(texts)
        rng.shuffle(ids)
        question = f"Question {rnd}: which document mentions the river, and what happened there?"
        for m in methods:
            if m == "full_prefill":
                layout = store.layout(question, ids, SYSTEM)
                t0 = time.perf_counter()
                pc.runner.prefill_plain(layout.token_ids, t0)
                t, res = time.perf_counter() - t0, None
            elif m == "exact_first_request":  # a fresh namespace each round: no link stored yet
                chains = DocumentStore(pc, namespace=f"exact{rnd}", exact=True)
                for d, tx in texts.items():
                    chains.add(d, tx)
                res = chains.prefill(question, ids, SYSTEM)
                t = res.ttft
            elif m in others:  # "NAME@R": another selection at the fraction R (or "auto")
                r = m.partition("@")[2]
                res = others[m].prefill(question, ids, SYSTEM, recompute="auto" if r in ("", "auto") else float(r))
                t = res.ttft
            else:  # "default@R": the default's selection at the fraction R
                r = 0 if m == "default_r0" else float(m.split("@")[1]) if "@" in m else None
                res = store.prefill(question, ids, SYSTEM, recompute=r)
                t = res.ttft
            if rnd:
                times.setdefault(m, []).append(t)
            if res is not None:
                info[m] = (res.prompt_tokens, res.reused_tokens, res.recomputed_tokens, res.exact)
            else:
                info[m] = (len(layout.token_ids), 0, 0, True)
    base = statistics.median(times["full_prefill"])
    rows = []
    for m in methods:
        med = statistics.median(times[m])
        prompt, reused, recomputed, exact = info[m]
        rows.append(dict(method=m, model=args.model, docs=args.docs, prompt_tokens=prompt, reused_tokens=reused,
                         recomputed_tokens=recomputed, exact=int(exact), median_ttft_ms=round(1e3 * med, 2),
                         min_ttft_ms=round(1e3 * min(times[m]), 2), rounds=len(times[m]),
                         speedup_vs_full=round(base / med, 2)))
        print(rows[-1], flush=True)
    return rows


def plot(rows: list[dict], path) -> None:
    plt = pyplot()
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(7, 3.5))
    ax.bar([r["method"] for r in rows], [r["median_ttft_ms"] for r in rows])
    for i, r in enumerate(rows):
        ax.text(i, r["median_ttft_ms"], f"{r['speedup_vs_full']}x", ha="center", va="bottom")
    ax.set(ylabel="median TTFT (ms)", title=f"{rows[0]['model']}: {rows[0]['docs']} documents, "
                                              f"{rows[0]['prompt_tokens']} prompt tokens")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_args(ap, "embedded:bench")
    ap.add_argument("--docs", type=int, default=4)
    ap.add_argument("--doc-tokens", type=int, default=240)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--budgets", type=float, nargs="*", default=[],
                    help="also time the default's selection at these recompute fractions (default@R rows)")
    ap.add_argument("--selections", nargs="*", default=[],
                    help="also time these engine selections, NAME@R or NAME@auto (eval/engine_selections.py's "
                         "study selections included)")
    ap.add_argument("--tag", default="")
    ap.add_argument("--out", default=RESULTS)
    args = ap.parse_args(argv)
    if args.model == "smollm2":
        from .accuracy import resolve_model

        args.model = resolve_model(args.model)
    rows = run(args)
    save_table(f"rag_ttft{args.tag}", rows, args.out, plot)
    return rows


if __name__ == "__main__":
    main()
