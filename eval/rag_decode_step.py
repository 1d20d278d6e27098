"""The decode step of a RAG batch: documents read in place at any position, what one step costs.

    OMP_NUM_THREADS=2 nice -n 10 python -m eval.rag_decode_step --model smollm2 --dtype float32,bfloat16
                                              [--questions 48] [--docs 16] [--k 4] [--doc-tokens 120] [--steps 8]

``eval/bench_batch.py``'s reuse workload (``--questions`` questions over ``--docs`` documents,
``--k`` of them each in a seeded random order, the default ``DocumentStore``: each document encoded
once, read in place from the store's tensor at whatever position a question puts it, its drifted
tokens recomputed as the question's own rows) is submitted to the engine ``generate`` runs on;
the engine steps until every question is decoding. Then decode steps of all the questions' rows
are timed two ways, alternating on the same batch (``--steps`` each; the machine's load shared by
both), and one step each way runs under ``torch.profiler``:

* ``fold on`` (the engine's default): each decode row's documents are runs of its slot list, one
  native call a layer for every row (``serving_core/decode_runs.py``);
* ``fold off`` (``paged.FOLD_SHARED`` off): how the engine read them before: every shared
  segment its own attention call a layer per group of rows at one shift, queries gathered, rotated
  back and merged by log-sum-exp.

Per way: median and fastest step (ms), ``aten_calls`` (``aten::`` events, nested calls counted,
as the profiler records them), ``native_layer`` (calls of the native attention ops a layer),
``index`` and ``index_put`` (``aten::index``, ``aten::index_put_``: the per-segment path's gathers
of each group's queries and scatters of its merged results), ``attention_ms`` (the profiled step's
self CPU time in the native attention ops and those gathers and scatters), and ``max_logit_diff``:
the largest difference of one step's logits computed both ways over the same pool (the step run
twice: the second writes the same keys and values again). Writes ``rag_decode_step{--tag}.csv`` and
``.png`` to ``--out`` (default eval/results/).
"""

from __future__ import annotations

import statistics
import sys
import time

from .bench_batch import SYSTEM, fold_bars, paired_runs, workload_parser


ATTENTION_OPS = ("aten::index", "aten::_index_put_impl_")  # with promptcache_native::*: the attention's time


def profiled(step, layers: int) -> dict:
    """Call counts and attention time of one call of ``step`` under torch.profiler."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step()
    names = [e.name for e in prof.events()]
    native = sum(n.startswith("promptcache_native::") for n in names)
    attention_us = sum(e.self_cpu_time_total for e in prof.key_averages()
                       if e.key.startswith("promptcache_native::") or e.key in ATTENTION_OPS)
    return dict(aten_calls=sum(n.startswith("aten::") for n in names), native_layer=round(native / layers, 2),
                index=names.count("aten::index"), index_put=names.count("aten::index_put_"),
                attention_ms=round(attention_us / 1e3, 1))


def measure(pc, store, pairs, args) -> list[dict]:
    """Decode steps of every question's row, the fold on and off alternately on one batch."""
    from promptcache import SamplingParams
    from promptcache.engine.serving_core import paged
    from promptcache.engine.serving_core.request import Request

    engine = pc.engine()
    sched = engine.scheduler
    # questions admitted first decode while the others are admitted: room for all of it (cancelled after)
    params = SamplingParams(max_new_tokens=2 * args.steps + 120, temperature=0.0, ignore_eos=True)
    reqs = [Request(store.prompt(q, ids, SYSTEM), params, pc.tokenizer) for q, ids in pairs]
    for r in reqs:
        engine.submit(r)
    t = time.perf_counter()
    while engine.has_incoming or any(r.prefilling or not r.token_ids for r in reqs):
        engine.step()
    admitted = time.perf_counter() - t
    forward, diffs = sched.forward, []

    def both_ways(pool, rows):  # the step's logits with the fold off, then on (the same keys written twice)
        paged.FOLD_SHARED = False
        off = forward(pool, rows).float()
        paged.FOLD_SHARED = True
        on = forward(pool, rows)
        diffs.append((on.float() - off).abs().max().item())
        return on

    sched.forward = both_ways
    engine.step()
    sched.forward = forward
    times = {True: [], False: []}
    for i in range(2 * args.steps):
        paged.FOLD_SHARED = i % 2 == 0
        t = time.perf_counter()
        engine.step()
        times[paged.FOLD_SHARED].append(time.perf_counter() - t)
    counts = {}
    for fold in (True, False):
        paged.FOLD_SHARED = fold
        counts[fold] = profiled(engine.step, pc.model.config.num_hidden_layers)
    paged.FOLD_SHARED = True
    if any(r.finished for r in reqs):
        raise RuntimeError("a request finished during the timed steps: raise max_new_tokens")
    for r in reqs:
        r.cancel()
    while engine.has_work:
        engine.step()
    return [dict(fold="on" if fold else "off", rows=len(reqs), admitted_s=round(admitted, 2),
                 step_ms=round(1e3 * statistics.median(times[fold]), 1), step_ms_min=round(1e3 * min(times[fold]), 1),
                 **counts[fold], max_logit_diff=float(f"{diffs[0]:.3g}")) for fold in (True, False)]


def plot(rows, path) -> None:
    fold_bars(rows, path, "step_ms", lambda r: f"{r['native_layer']:g} call(s)/layer\n{r['aten_calls']} aten",
              "ms per decode step (median)", "decode step")


def main(argv=None) -> list[dict]:
    ap = workload_parser(__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=8, help="timed decode steps each way")
    args = ap.parse_args(argv)

    return paired_runs(args, measure, f"rag_decode_step{args.tag}",
                       f"{'dtype':<10}{'fold':<6}{'step ms':>9}{'min ms':>8}{'attn ms':>9}{'aten':>8}{'native/layer':>14}"
                       f"{'index':>7}{'index_put':>10}{'logit diff':>12}",
                       lambda r: f"{r['dtype']:<10}{r['fold']:<6}{r['step_ms']:>9}{r['step_ms_min']:>8}{r['attention_ms']:>9}"
                                 f"{r['aten_calls']:>8}{r['native_layer']:>14}{r['index']:>7}{r['index_put']:>10}{r['max_logit_diff']:>12}", plot)


if __name__ == "__main__":
    sys.exit(main() and None)
