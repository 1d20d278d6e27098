"""Admission of a RAG batch: its prefill rows read their documents in one native call a layer, or one a piece.

    OMP_NUM_THREADS=2 nice -n 10 python -m eval.rag_admission --model smollm2 --dtype bfloat16
                                            [--questions 48] [--docs 16] [--k 4] [--doc-tokens 120] [--repeats 3]

``eval/bench_batch.py``'s reuse workload (``--questions`` questions over ``--docs`` documents, ``--k``
of them each in a seeded random order, the default ``DocumentStore``: each document read in place
from the store's tensor at whatever position a question puts it, its drifted tokens recomputed as
the question's own rows with key limits) is admitted: submitted to the engine ``generate`` runs on,
stepped until every question has its first token (``admitted_s``), then cancelled. Two ways,
alternating ``--repeats`` times each on one engine (the machine's load shared by both):

* ``fold on`` (the engine's default): each prefill row's documents and own tokens are runs of one
  slot list, every prefill row of a step in one native call a layer (``attend_prefill_runs``);
* ``fold off`` (``paged.FOLD_PREFILL`` off): how the engine read them before: the own tokens a
  causal call, each document group a call (queries gathered, rotated back, merged by log-sum-exp),
  each document a recomputing row sees a prefix of a call with key limits (``attend_limits``).

Per way: median and fastest ``admitted_s``, and ``attention_calls`` (native attention calls of the
prefill paths a layer over one admission: ``attend``, ``attend_limits``, ``attend_prefill_runs``).
Writes ``rag_admission{--tag}.csv`` and ``.png`` to ``--out`` (default eval/results/).
"""

from __future__ import annotations

import statistics
import sys
import time

from .bench_batch import SYSTEM, fold_bars, paired_runs, workload_parser

COUNTED = ("kernel_for", "limits_kernel_for", "prefill_runs_kernel_for")  # the prefill paths' native ops


def admit(pc, store, pairs, fold: bool, calls: dict) -> float:
    """Seconds until every question has its first token, the prefill fold ``fold``; ``calls``
    counts the native ops the prefill paths asked for."""
    from promptcache import SamplingParams
    from promptcache.engine.serving_core import paged
    from promptcache.engine.serving_core.request import Request

    paged.FOLD_PREFILL = fold
    engine = pc.engine()
    params = SamplingParams(max_new_tokens=4, temperature=0.0, ignore_eos=True)
    reqs = [Request(store.prompt(q, ids, SYSTEM), params, pc.tokenizer) for q, ids in pairs]
    calls.clear()
    t = time.perf_counter()
    for r in reqs:
        engine.submit(r)
    while engine.has_incoming or any(r.prefilling or not r.token_ids for r in reqs):
        engine.step()
    seconds = time.perf_counter() - t
    for r in reqs:
        r.cancel()
    while engine.has_work:
        engine.step()
    paged.FOLD_PREFILL = True
    return seconds


def measure(pc, store, pairs, args) -> list[dict]:
    from promptcache.kernels import attention as cpu_attention

    calls: dict[str, int] = {}
    real = {name: getattr(cpu_attention, name) for name in COUNTED}

    def counted(name):  # the op handed out, its calls counted (a coverage check alone is no call)
        def wrapper(*a):
            op = real[name](*a)
            if op is None:
                return None

            def call(*x):
                calls[name] = calls.get(name, 0) + 1
                return op(*x)
            return call
        return wrapper

    for name in COUNTED:
        setattr(cpu_attention, name, counted(name))
    try:
        admit(pc, store, pairs, True, calls)  # warm up: kernels, pool pages
        times, counts = {True: [], False: []}, {}
        for i in range(2 * args.repeats):
            fold = i % 2 == 0
            times[fold].append(admit(pc, store, pairs, fold, calls))
            counts[fold] = sum(calls.values())
    finally:
        for name in COUNTED:
            setattr(cpu_attention, name, real[name])
    layers = pc.model.config.num_hidden_layers
    return [dict(fold="on" if fold else "off", rows=len(pairs), admitted_s=round(statistics.median(times[fold]), 2),
                 admitted_s_min=round(min(times[fold]), 2), attention_calls=round(counts[fold] / layers, 1))
            for fold in (True, False)]


def plot(rows, path) -> None:
    fold_bars(rows, path, "admitted_s", lambda r: f"{r['attention_calls']:g} native calls/layer", "s to admit the batch (median)", "admission")


def main(argv=None) -> list[dict]:
    ap = workload_parser(__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=3, help="timed admissions each way")
    args = ap.parse_args(argv)

    return paired_runs(args, measure, f"rag_admission{args.tag}",
                       f"{'dtype':<10}{'fold':<6}{'admitted s':>12}{'min s':>8}{'native calls/layer':>20}",
                       lambda r: f"{r['dtype']:<10}{r['fold']:<6}{r['admitted_s']:>12}{r['admitted_s_min']:>8}{r['attention_calls']:>20}", plot)


if __name__ == "__main__":
    sys.exit(main() and None)
