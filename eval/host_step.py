"""Where a served decode step's time goes: the scheduler's step of a RAG batch, section by section.

    nice -n 10 python -m eval.host_step [--model embedded] [--compile on] [--native off] [--pool-documents on]
                                        [--questions 48] [--docs 16] [--k 4] [--doc-tokens 64] [--steps 20]

``eval/bench_batch.py``'s reuse workload (``--questions`` questions over ``--docs`` documents, ``--k``
each, the default ``DocumentStore``: documents read in place from the store's tensors at whatever
position a question puts them) is submitted to an engine (``--compile on``: ``RunnerConfig.compile``'s
serving steps; ``--native off``: without the native CPU attention kernel, the path a GPU takes, where
``--pool-documents on`` copies the documents into the pool so that they join the step's one attention
call a layer, ``off`` reads them in place, a call and a merge per (document, shift): the
``tunables.POOL_DOCUMENTS`` switch); the
engine steps until every question decodes, then ``--steps`` decode steps of all of them are timed,
each split into sections by timing the functions the step calls (wrapped for the run):

* ``forward_ms``: the scheduler's forward (``ServingScheduler.forward``): of it ``inputs_ms``
  (``step_inputs``: ids, positions, write slots), ``plan_ms`` (``build_plan``) and ``call_ms``, the
  rest: the model's call (compiled: dynamo's guards, inductor's graph, the attention ops; its
  kernels included);
* ``sample_ms``: ``Request.sample_next`` of every row (the pick, the stop checks, the text
  decoded), ``emit_ms``: ``Request.emit`` (the step's outputs);
* ``rest_ms``: the step less those: picking the rows and building them (``PagedRow``), the batch's
  argmax and its ``.tolist()``, publishing blocks, cancellations;

medians over the steps; ``step_ms``: the whole step. Then ``--repeats`` steps run under
``torch.profiler`` (``host_overhead.profile_step``): ``kernel_ms``, ``host_ms`` and its parts as that
script defines them (medians). Writes ``host_step{--tag}.csv`` (a row per setting: a run replaces
its setting's row) and ``.png`` (the sections as stacked bars) to ``--out`` (default eval/figures).
"""

from __future__ import annotations

import csv
import os
import statistics
import time
from pathlib import Path

from .bench_batch import SYSTEM, add_workload_args, make_store, questions
from .common import add_model_args, pyplot, save_figure, save_table
from .host_overhead import TIMES, profile_step

FIGURES = Path(__file__).resolve().parent / "figures"
SECTIONS = ("forward_ms", "inputs_ms", "plan_ms", "sample_ms", "emit_ms")


def timed(owner, name: str, into: list[float]):
    """``owner.name`` wrapped to add each call's seconds to ``into[-1]``; returns the original."""
    original = getattr(owner, name)

    def wrapper(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            into[-1] += time.perf_counter() - t0

    setattr(owner, name, wrapper)
    return original


def add_batch_args(ap) -> None:
    """The model, the workload (documents of 64 tokens), ``--compile`` and ``--native``: what
    ``decoding_batch`` reads (shared with eval/device_ids.py)."""
    add_model_args(ap, model="embedded")
    add_workload_args(ap)
    ap.set_defaults(doc_tokens=64)
    ap.add_argument("--compile", choices=("on", "off"), default="on")
    ap.add_argument("--native", choices=("on", "off"), default="off",
                    help="the native CPU attention kernel (off: the path a GPU takes)")


def decoding_batch(args, steps: int):
    """(model, engine, requests): the workload's questions submitted to an engine over ``args.model``
    (``args.compile``), stepped until every one decodes, then 3 decode steps more (a compiled graph
    of this batch's shape warmed); each may decode ``steps`` tokens more."""
    import torch

    from promptcache import EngineConfig, PromptCache, RunnerConfig, SamplingParams
    from promptcache.engine.serving_core.request import Request
    from promptcache.models.embedded import embedded_model, is_embedded
    from promptcache.models.loading import load_model

    torch.set_num_threads(1)
    if is_embedded(args.model):
        model, tok = embedded_model(args.model, dtype=getattr(torch, args.dtype))
    else:
        model, tok = load_model(args.model, device=args.device, dtype=args.dtype)
    pc = PromptCache(model, tok, EngineConfig(runner=RunnerConfig(compile=args.compile == "on")))
    texts, pairs = questions(tok, args)
    store = make_store(pc, "fast", texts)
    engine = pc.engine()
    params = SamplingParams(max_new_tokens=steps + 64, temperature=0.0, ignore_eos=True)
    reqs = [Request(store.prompt(q, ids, SYSTEM), params, pc.tokenizer) for q, ids in pairs]
    for r in reqs:
        engine.submit(r)
    while engine.has_incoming or any(r.prefilling or not r.token_ids for r in reqs):
        engine.step()
    for _ in range(3):
        engine.step()
    return model, engine, reqs


def end_batch(engine, reqs) -> None:
    """Fail where the batch changed while it was measured (a request finished or paused); then
    cancel it and step until the engine is idle."""
    if any(r.finished for r in reqs) or len(engine.scheduler.running) != len(reqs):
        raise RuntimeError("a request finished or paused during the measured steps: the batch changed")
    for r in reqs:
        r.cancel()
    while engine.has_work:
        engine.step()


def measure(args) -> dict:
    from promptcache import tunables
    from promptcache.engine.serving_core import graphs, paged
    from promptcache.engine.serving_core.request import Request
    from promptcache.kernels import attention as cpu_attention

    tunables.POOL_DOCUMENTS = args.pool_documents == "on"
    model, engine, reqs = decoding_batch(args, args.steps + args.repeats)
    sched = engine.scheduler
    spent = {k: [] for k in SECTIONS}
    originals = [(sched, "forward", timed(sched, "forward", spent["forward_ms"]))]
    for module in (graphs, paged):  # the names CompiledSteps.forward and paged_forward call
        originals += [(module, "step_inputs", timed(module, "step_inputs", spent["inputs_ms"])),
                      (module, "build_plan", timed(module, "build_plan", spent["plan_ms"]))]
    originals += [(Request, "sample_next", timed(Request, "sample_next", spent["sample_ms"])),
                  (Request, "emit", timed(Request, "emit", spent["emit_ms"]))]
    steps = []
    try:
        for _ in range(args.steps):
            for v in spent.values():
                v.append(0.0)
            t0 = time.perf_counter()
            engine.step()
            steps.append(time.perf_counter() - t0)
    finally:
        for owner, name, original in reversed(originals):
            setattr(owner, name, original)
    profs = [profile_step(engine.step, model.config.num_hidden_layers) for _ in range(args.repeats)]
    end_batch(engine, reqs)
    ms = {k: [1e3 * x for x in v] for k, v in spent.items()}
    call = [f - i - p for f, i, p in zip(ms["forward_ms"], ms["inputs_ms"], ms["plan_ms"])]
    rest = [1e3 * s - f - a - e for s, f, a, e in zip(steps, ms["forward_ms"], ms["sample_ms"], ms["emit_ms"])]
    row = dict(model=args.model, compile=args.compile, native="on" if cpu_attention.available() else "off",
               pool_documents="on" if sched.pools_documents else "off", rows=len(reqs), step_ms=round(1e3 * statistics.median(steps), 3),
               **{k: round(statistics.median(v), 3) for k, v in ms.items()},
               call_ms=round(statistics.median(call), 3), rest_ms=round(statistics.median(rest), 3))
    row.update({k: round(statistics.median(p[k] for p in profs), 3) for k in TIMES},
               host_min_ms=min(p["host_ms"] for p in profs), calls_layer=profs[0]["calls_layer"],
               attn_calls_layer=profs[0]["attn_calls_layer"], load=round(os.getloadavg()[0], 2))
    return row


def plot(rows: list[dict], path: Path) -> None:
    """A stacked bar a setting: the step's sections (ms)."""
    plt = pyplot()
    if plt is None:
        return
    parts = ("inputs_ms", "plan_ms", "call_ms", "sample_ms", "emit_ms", "rest_ms")
    fig, ax = plt.subplots(figsize=(9, 1.2 + 0.6 * len(rows)))
    labels = [f"compile {r['compile']}, native {r['native']}, pool docs {r.get('pool_documents', 'off')}, "
              f"B={r['rows']}" for r in rows]
    left = [0.0] * len(rows)
    for part in parts:
        width = [max(float(r[part]), 0.0) for r in rows]
        ax.barh(labels, width, left=left, label=part[:-3])
        left = [a + b for a, b in zip(left, width)]
    ax.set(xlabel="ms per decode step (median)", title="a served decode step, section by section")
    ax.legend(fontsize=8, ncol=len(parts))
    save_figure(fig, path)


def main(argv=None) -> None:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_batch_args(ap)
    ap.add_argument("--pool-documents", choices=("on", "off"), default="on",
                    help="without the native kernel: documents copied into the pool (tunables.POOL_DOCUMENTS)")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=3, help="profiled steps")
    ap.add_argument("--tag", default="", help="appended to the CSV's name; rows of an existing one are kept")
    ap.add_argument("--out", default=str(FIGURES))
    args = ap.parse_args(argv)
    # read once, when the kernel first loads (nothing has loaded it yet in this process)
    os.environ["PROMPTCACHE_NATIVE_ATTENTION"] = "1" if args.native == "on" else "0"
    row = measure(args)
    print("  ".join(f"{k}={v}" for k, v in row.items()))
    path = Path(args.out) / f"host_step{args.tag}.csv"
    rows = []
    if path.exists():  # a setting's row replaces its earlier one; the others' stay
        with path.open() as f:
            rows = [r for r in csv.DictReader(f) if (r["compile"], r["native"], r.get("pool_documents", "off"))
                    != (row["compile"], row["native"], row["pool_documents"])]
    save_table(f"host_step{args.tag}", rows + [row], args.out, plot)


if __name__ == "__main__":
    main()
