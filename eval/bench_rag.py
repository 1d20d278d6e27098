"""RAG workload benchmark: DocumentStore modes against no cache on a stream of retrieval requests.

    nice -n 10 python eval/bench_rag.py [--docs 100] [--queries 500] [--k 4] [--zipf 1.0] [--model embedded:bench]

``--docs`` documents of about ``--doc-tokens`` tokens; ``--queries`` requests, each retrieving
``--k`` distinct documents drawn with Zipf(``--zipf``) popularity (document ids are shuffled
against popularity, so ``canonical_order``, which sorts by id, is not handed the popular ones
first), in the retriever's order (random per request). Modes, each on its own engine, every
request in the same sequence:

* ``no_cache``: the stock model over the prompt's tokens (``prefill_baseline``-equivalent);
* ``exact``: ``DocumentStore`` chains (the default): exact, reused when leading documents match;
* ``exact_canonical``: chains with ``canonical_order=True``;
* ``independent``: ``DocumentStore(independent=True)``, documents encoded once at ``add``.

Per mode: token hit rate (cached tokens / prompt tokens), mean and p90 TTFT, speed-up of the mean
against no cache. Writes ``bench_rag.csv`` to ``--out`` (default eval/results/).
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS, add_model_args, text_of_tokens, write_csv  # noqa: E402

from promptcache import PromptCache  # noqa: E402
from promptcache.models.loading import load_model  # noqa: E402
from promptcache.rag import DocumentStore  # noqa: E402

SYSTEM = "Answer the question from the documents only."
MODES = ("no_cache", "exact", "exact_canonical", "independent")


def workload(docs: int, queries: int, k: int, s: float, seed: int = 0) -> list[list[str]]:
    """Per request, ``k`` distinct document ids (Zipf popularity, retriever order)."""
    rng = random.Random(seed)
    ids = [f"d{i:03d}" for i in range(docs)]
    rng.shuffle(ids)  # popularity rank -> id: unrelated to id order
    weights = [1.0 / (r + 1) ** s for r in range(docs)]
    out = []
    for _ in range(queries):
        pick: list[str] = []
        while len(pick) < k:
            d = rng.choices(ids, weights)[0]
            if d not in pick:
                pick.append(d)
        out.append(pick)
    return out


def p90(xs: list[float]) -> float:
    return sorted(xs)[max(0, round(0.9 * len(xs)) - 1)]


def run(args) -> list[dict]:
    torch.set_num_threads(max(1, min(args.threads, torch.get_num_threads())))
    model, tok = load_model(args.model, device=args.device, dtype=args.dtype)
    texts = {f"d{i:03d}": text_of_tokens(tok, args.doc_tokens, seed=i) for i in range(args.docs)}
    requests = workload(args.docs, args.queries, args.k, args.zipf)
    rows = []
    for mode in args.modes:
        pc = PromptCache(model, tok)
        store = DocumentStore(pc, independent=mode == "independent", canonical_order=mode == "exact_canonical")
        for d, t in texts.items():
            store.add(d, t)
        ttft, hit = [], []
        for qi, ids in enumerate(requests):
            question = f"Question {qi}: which document mentions the river?"
            if mode == "no_cache":
                layout = store.layout(question, ids, SYSTEM)
                t0 = time.perf_counter()
                pc.runner.prefill_plain(layout.token_ids, t0)
                ttft.append(time.perf_counter() - t0)
                hit.append(0.0)
                continue
            res = store.prefill(question, ids, SYSTEM)
            ttft.append(res.ttft)
            hit.append(res.cached_tokens / res.prompt_tokens)
        rows.append(dict(mode=mode, model=args.model, docs=args.docs, queries=args.queries, k=args.k, zipf=args.zipf,
                         token_hit_rate=round(statistics.mean(hit), 4), mean_ttft_ms=round(1e3 * statistics.mean(ttft), 2),
                         p90_ttft_ms=round(1e3 * p90(ttft), 2)))
        print(rows[-1], flush=True)
    base = next((r["mean_ttft_ms"] for r in rows if r["mode"] == "no_cache"), None)
    for r in rows:
        r["speedup_vs_no_cache"] = round(base / r["mean_ttft_ms"], 2) if base else None
    return rows


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_args(ap, "embedded:bench")
    ap.add_argument("--docs", type=int, default=100)
    ap.add_argument("--queries", type=int, default=500)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--zipf", type=float, default=1.0)
    ap.add_argument("--doc-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args(argv)
    rows = run(args)
    print("wrote", write_csv("bench_rag.csv", rows, args.out))
    return rows


if __name__ == "__main__":
    main()
