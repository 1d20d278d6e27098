"""RAG workload benchmark: DocumentStore modes against no cache on a stream of retrieval requests.

    nice -n 10 python -m eval.bench_rag [--docs 100] [--queries 500] [--k 4] [--zipf 1.0] [--model embedded:bench]

``--docs`` documents of about ``--doc-tokens`` tokens; ``--queries`` requests, each retrieving
``--k`` distinct documents drawn with Zipf(``--zipf``) popularity (document ids are shuffled
against popularity, so ``canonical_order``, which sorts by id, is not handed the popular ones
first), in the retriever's order (random per request), behind a one-line system prompt
(``--system-tokens N`` makes it N tokens longer, as applications' instructions are). Modes, each
on its own engine (host store budget ``--budget-gib``, LRU), the requests interleaved across modes
(request i through every mode, then i + 1: load from other processes falls on all alike):

* ``no_cache``: the stock model over the prompt's tokens (``prefill_baseline``-equivalent);
* ``default``: ``DocumentStore(pc)``, the default mode (docs/rag.md): every document encoded at
  ``add``, reused in any subset and order, its drift recomputed (``auto``, ``qmatch``); alone on its
  engine, so no chain stored by an exact store covers a request (every document is independent);
* ``exact``: ``DocumentStore(exact=True)`` chains: exact, reused when leading documents match;
* ``exact_canonical``: chains with ``canonical_order=True``;
* ``independent``: ``DocumentStore(independent=True)``: the default's states without the chain
  lookup (the same work here).

Cached modes run at the engine's default ``recompute="auto"`` (independent documents drift, so
0.15 of their tokens are recomputed); ``--recompute R`` sets another fraction.

Per mode: token hit rate (tokens served from stored states / prompt tokens: recomputed ones are
not), mean and p90 TTFT, speed-up of the mean
against no cache, ``work_ceiling`` = 1 / (1 - hit rate) (the speed-up if cost were proportional
to the tokens run), the lowest and highest 1-minute load average seen. ``--baseline-every N`` times no_cache on
every Nth request only (a plain prefill's cost does not depend on what ran before; the cached
modes always run and time the whole stream, since each request changes what later ones reuse).
``chain_hit_rates`` gives the chains' token hit rate of a stream without a model (the ceiling on
what reuse can save: at most 1 / (1 - hit rate) of prefill work). Writes ``bench_rag{--tag}.csv``
to ``--out`` (default eval/results/).
"""

from __future__ import annotations

import argparse
import fcntl
import os
import random
import statistics
import time
from pathlib import Path

import torch

from .common import RESULTS, add_model_args, text_of_tokens, write_csv

from promptcache import EngineConfig, PromptCache, RecomputeConfig, StoreConfig
from promptcache.models.loading import load_model
from promptcache.rag import DocumentStore

SYSTEM = "Answer the question from the documents only."
MODES = ("no_cache", "default", "exact", "exact_canonical", "independent")


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


class MeasureLock:
    """An exclusive ``flock`` on ``path`` (a machine-wide lock that timing runs share), taken for
    one chunk of requests at a time so a long stream does not hold it throughout."""

    def __init__(self, path: str):
        self.fd, self.held = os.open(path, os.O_RDWR | os.O_CREAT, 0o666), False

    def acquire(self) -> None:
        fcntl.flock(self.fd, fcntl.LOCK_EX)
        self.held = True

    def release(self) -> None:
        if self.held:
            fcntl.flock(self.fd, fcntl.LOCK_UN)
            self.held = False


def chain_hit_rates(requests: list[list[str]], canonical: bool, tokens: dict[str, int], fixed: int,
                    question: int) -> list[float]:
    """Per request, the token hit rate chains get on this stream: the ``fixed`` prefix tokens and
    the leading documents whose chain an earlier request stored, over all prompt tokens."""
    tree, out = set(), []
    for ids in requests:
        ids = sorted(ids) if canonical else list(ids)
        m = 0
        while m < len(ids) and tuple(ids[: m + 1]) in tree:
            m += 1
        tree.update(tuple(ids[: i + 1]) for i in range(len(ids)))
        total = fixed + sum(tokens[d] for d in ids) + question
        out.append((fixed + sum(tokens[d] for d in ids[:m])) / total)
    return out


def p90(xs: list[float]) -> float:
    return sorted(xs)[max(0, round(0.9 * len(xs)) - 1)]


def run(args) -> list[dict]:
    """Every mode on its own engine, requests interleaved (request i through every mode, then
    request i + 1), so load from other processes falls on all modes alike."""
    torch.set_num_threads(max(1, min(args.threads, torch.get_num_threads())))
    model, tok = load_model(args.model, device=args.device, dtype=args.dtype)
    texts = {f"d{i:03d}": text_of_tokens(tok, args.doc_tokens, seed=i) for i in range(args.docs)}
    system = SYSTEM if not args.system_tokens else SYSTEM + " " + text_of_tokens(tok, args.system_tokens, seed=-1)
    requests = workload(args.docs, args.queries, args.k, args.zipf)
    budget = int(args.budget_gib * 2**30)
    stores = {}
    for mode in args.modes:
        pc = PromptCache(model, tok, EngineConfig(store=StoreConfig(host_budget=budget),
                                                recompute=RecomputeConfig(fraction=args.recompute)))
        stores[mode] = DocumentStore(pc, exact=mode.startswith("exact") or mode == "no_cache",
                                     independent=mode == "independent", canonical_order=mode == "exact_canonical",
                                     system=system)
        for d, t in texts.items():
            stores[mode].add(d, t)
    ttft, hit = {m: [] for m in args.modes}, {m: [] for m in args.modes}
    lock, loads = MeasureLock(args.lock) if args.lock else None, []
    for qi, ids in enumerate(requests):
        if qi % args.lock_every == 0:
            loads.append(os.getloadavg()[0])
            if lock is not None:
                lock.release()  # let other timing runs in between chunks
                lock.acquire()
        question = f"Question {qi}: which document mentions the river?"
        for mode, store in stores.items():
            if mode == "no_cache":
                if qi % args.baseline_every:  # its cost does not depend on the stream's history
                    continue
                layout = store.layout(question, ids, system)
                t0 = time.perf_counter()
                store.pc.runner.prefill_plain(layout.token_ids, t0)
                ttft[mode].append(time.perf_counter() - t0)
                hit[mode].append(0.0)
                continue
            res = store.prefill(question, ids, system)
            ttft[mode].append(res.ttft)
            hit[mode].append(res.reused_tokens / res.prompt_tokens)
        if args.progress and (qi + 1) % args.progress == 0:
            means = " ".join(f"{m} {1e3 * statistics.mean(t):.0f} ms" for m, t in ttft.items() if t)
            print(f"{qi + 1} requests: {means}", flush=True)
    if lock is not None:
        lock.release()
    rows = []
    for mode in args.modes:
        h, t = hit[mode], ttft[mode]
        rows.append(dict(mode=mode, model=args.model, docs=args.docs, queries=args.queries, timed=len(t), k=args.k,
                         zipf=args.zipf, doc_tokens=args.doc_tokens, system_tokens=args.system_tokens,
                         token_hit_rate=round(statistics.mean(h), 4),
                         mean_ttft_ms=round(1e3 * statistics.mean(t), 2), p90_ttft_ms=round(1e3 * p90(t), 2),
                         work_ceiling=round(1 / max(1e-9, 1 - statistics.mean(h)), 2),
                         load_avg_1m_min=round(min(loads), 2),
                         load_avg_1m_max=round(max(loads + [os.getloadavg()[0]]), 2)))
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
    ap.add_argument("--system-tokens", type=int, default=0,
                    help="a system prompt this many tokens longer than the one-line default (a shared prefix every "
                         "request carries, as applications' instructions do: the cached modes reuse it, no_cache runs it)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--lock", default=None, help="flock this file while timing (e.g. /tmp/measure.lock)")
    ap.add_argument("--lock-every", type=int, default=100, help="with --lock: release it between chunks of N requests")
    ap.add_argument("--tag", default="", help="written to bench_rag{tag}.csv")
    ap.add_argument("--budget-gib", type=float, default=2.0, help="host store budget per mode's engine (LRU)")
    ap.add_argument("--progress", type=int, default=0, help="print running means every N requests")
    ap.add_argument("--baseline-every", type=int, default=1,
                    help="no_cache: time every Nth request only (its TTFT does not depend on the stream)")
    ap.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    ap.add_argument("--recompute", default="auto", type=lambda v: v if v.strip().lower() == "auto" else float(v),
                    help="EngineConfig.recompute.fraction of the cached modes ('auto' or a fraction)")
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args(argv)
    rows = run(args)
    print("wrote", write_csv(f"bench_rag{args.tag}.csv", rows, args.out))
    return rows


if __name__ == "__main__":
    main()
