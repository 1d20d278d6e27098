"""Sampled ids kept on the device between decode steps, against ids made from the host's every step.

    nice -n 10 python -m eval.device_ids [--model embedded] [--compile on] [--native off] [--questions 48]
                                         [--steps 40]

``eval/bench_batch.py``'s reuse workload (as ``eval/host_step.py`` serves it) decodes on one engine;
its decode steps alternate, in pairs, between a step whose input ids are the last step's argmax
tensor as it is (``ServingScheduler.device_ids`` on the step before: ``PagedRow.sampled``) and one
whose ids are made from the host's ints (``device_ids`` off the step before), so both are measured
under the same load, interleaved. Per setting, medians over ``--steps`` steps: ``step_ms`` (the
scheduler's step), ``inputs_ms`` (``paged.step_inputs``: ids, positions, write slots) and
``rest_ms`` (the step less its forward: scheduling and row building, the argmax read back, sampling,
stop checks and outputs); a step whose ids did not come from where its setting says fails the run
(the tokens are the same either way: tests/engine/test_device_ids.py). Writes ``device_ids{--tag}.csv`` and ``.png`` to ``--out`` (default eval/figures).
"""

from __future__ import annotations

import os
import statistics
import time
from pathlib import Path

from .bench_batch import SYSTEM, add_workload_args, make_store, questions
from .common import add_model_args, pyplot, save_figure, save_table
from .host_step import timed

FIGURES = Path(__file__).resolve().parent / "figures"


def measure(args) -> list[dict]:
    import torch

    from promptcache import EngineConfig, PromptCache, RunnerConfig, SamplingParams
    from promptcache.engine.serving_core import graphs, paged
    from promptcache.engine.serving_core.request import Request
    from promptcache.kernels import attention as cpu_attention
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
    sched = engine.scheduler
    params = SamplingParams(max_new_tokens=2 * args.steps + 64, temperature=0.0, ignore_eos=True)
    reqs = [Request(store.prompt(q, ids, SYSTEM), params, pc.tokenizer) for q, ids in pairs]
    for r in reqs:
        engine.submit(r)
    while engine.has_incoming or any(r.prefilling or not r.token_ids for r in reqs):
        engine.step()
    for _ in range(3):  # warm (a compiled graph of this batch's shape)
        engine.step()
    spent = {"forward": [], "inputs": []}
    originals = [(sched, "forward", timed(sched, "forward", spent["forward"]))]
    for module in (graphs, paged):  # the name CompiledSteps.forward and paged_forward call
        originals.append((module, "step_inputs", timed(module, "step_inputs", spent["inputs"])))
    cells = {on: {"step": [], "forward": [], "inputs": []} for on in (True, False)}
    try:
        for i in range(2 * args.steps):
            on = (i // 2) % 2 == 0  # T, T, F, F, ...: the second of a pair reads what the first left
            sched.device_ids = on
            for v in spent.values():
                v.append(0.0)
            before = sched.device_id_steps
            t0 = time.perf_counter()
            engine.step()
            seconds = time.perf_counter() - t0
            if i % 2:
                if (sched.device_id_steps > before) != on:
                    raise RuntimeError("a step's ids did not come from where the setting says")
                cell = cells[on]
                cell["step"].append(seconds)
                cell["forward"].append(spent["forward"][-1])
                cell["inputs"].append(spent["inputs"][-1])
    finally:
        for owner, name, original in reversed(originals):
            setattr(owner, name, original)
    if any(r.finished for r in reqs) or len(sched.running) != len(reqs):
        raise RuntimeError("a request finished or paused during the measured steps: the batch changed")
    for r in reqs:
        r.cancel()
    while engine.has_work:
        engine.step()
    out = []
    for on, cell in cells.items():
        ms = {k: [1e3 * x for x in v] for k, v in cell.items()}
        rest = [s - f for s, f in zip(ms["step"], ms["forward"])]
        out.append(dict(model=args.model, compile=args.compile, native="on" if cpu_attention.available() else "off",
                        device_ids="on" if on else "off", rows=len(reqs), steps=len(ms["step"]),
                        step_ms=round(statistics.median(ms["step"]), 3),
                        inputs_ms=round(statistics.median(ms["inputs"]), 4),
                        rest_ms=round(statistics.median(rest), 3), load=round(os.getloadavg()[0], 2)))
    return out


def plot(rows: list[dict], path: Path) -> None:
    plt = pyplot()
    if plt is None:
        return
    fig, axes = plt.subplots(1, 3, figsize=(10, 3))
    labels = [f"ids {r['device_ids']}" for r in rows]
    for ax, key in zip(axes, ("step_ms", "inputs_ms", "rest_ms")):
        ax.bar(labels, [float(r[key]) for r in rows], color=["C0" if r["device_ids"] == "on" else "C7" for r in rows])
        ax.set_title(key[:-3] + " (ms, median)", fontsize=9)
    fig.suptitle(f"{rows[0]['model']}: decode steps of {rows[0]['rows']} rows, sampled ids kept on the device or not",
                 fontsize=9)
    save_figure(fig, path)


def main(argv=None) -> None:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_args(ap, model="embedded")
    add_workload_args(ap)
    ap.set_defaults(doc_tokens=64)
    ap.add_argument("--compile", choices=("on", "off"), default="on")
    ap.add_argument("--native", choices=("on", "off"), default="off",
                    help="the native CPU attention kernel (off: the path a GPU takes)")
    ap.add_argument("--steps", type=int, default=40, help="measured steps a setting")
    ap.add_argument("--tag", default="")
    ap.add_argument("--out", default=str(FIGURES))
    args = ap.parse_args(argv)
    os.environ["PROMPTCACHE_NATIVE_ATTENTION"] = "1" if args.native == "on" else "0"
    rows = measure(args)
    for row in rows:
        print("  ".join(f"{k}={v}" for k, v in row.items()))
    save_table(f"device_ids{args.tag}", rows, args.out, plot)


if __name__ == "__main__":
    main()
