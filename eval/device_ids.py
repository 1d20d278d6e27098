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
stop checks and outputs); and ``inputs_alone_us``: ``step_inputs`` alone on 48 decode rows built
once, each setting's calls interleaved in blocks of 200 (median of 30 blocks, microseconds a call),
the difference the served step's noise hides under load. A step whose ids did not come from where its setting says fails the run
(the tokens are the same either way: tests/engine/test_device_ids.py). Writes ``device_ids{--tag}.csv`` and ``.png`` to ``--out`` (default eval/figures).
"""

from __future__ import annotations

import os
import statistics
import time
from pathlib import Path

from .common import pyplot, save_figure, save_table
from .host_step import add_batch_args, decoding_batch, end_batch, timed

FIGURES = Path(__file__).resolve().parent / "figures"


def inputs_alone(rows: int, blocks: int = 30, calls: int = 200) -> dict[bool, float]:
    """Microseconds a ``step_inputs`` call on ``rows`` decode rows, with their ids kept on the device
    (True) and made from the host's (False): the median of ``blocks`` interleaved blocks of ``calls``."""
    import torch

    from promptcache.engine.serving_core import paged
    from promptcache.engine.serving_core.kvpool import KVPool
    from promptcache.models.splice import KVSpec

    pool = KVPool(KVSpec(layers=1, kv_heads=1, head_dim=16, dtype=torch.float32), torch.device("cpu"), rows * 64, 16)
    kept = torch.arange(rows)
    tables = [pool.allocate(4) for _ in range(rows)]
    made = {on: [paged.PagedRow([i], [30], [], pool.slots(b, 0, 31), own_blocks=b, sampled=kept if on else None)
                 for i, b in enumerate(tables)] for on in (True, False)}
    times = {True: [], False: []}
    for _ in range(blocks):
        for on, batch in made.items():
            t0 = time.perf_counter()
            for _ in range(calls):
                paged.step_inputs(pool, batch)
            times[on].append(1e6 * (time.perf_counter() - t0) / calls)
    return {on: statistics.median(v) for on, v in times.items()}


def measure(args) -> list[dict]:
    from promptcache.engine.serving_core import graphs, paged
    from promptcache.kernels import attention as cpu_attention

    _, engine, reqs = decoding_batch(args, 4 * args.steps)
    sched = engine.scheduler
    spent = {"forward": [], "inputs": []}
    originals = [(sched, "forward", timed(sched, "forward", spent["forward"]))]
    for module in (graphs, paged):  # the name CompiledSteps.forward and paged_forward call
        originals.append((module, "step_inputs", timed(module, "step_inputs", spent["inputs"])))
    cells = {on: {"step": [], "forward": [], "inputs": []} for on in (True, False)}
    try:
        for i in range(4 * args.steps):
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
    end_batch(engine, reqs)
    alone = inputs_alone(len(reqs))
    out = []
    for on, cell in cells.items():
        ms = {k: [1e3 * x for x in v] for k, v in cell.items()}
        rest = [s - f for s, f in zip(ms["step"], ms["forward"])]
        out.append(dict(model=args.model, compile=args.compile, native="on" if cpu_attention.available() else "off",
                        device_ids="on" if on else "off", rows=len(reqs), steps=len(ms["step"]),
                        step_ms=round(statistics.median(ms["step"]), 3),
                        inputs_ms=round(statistics.median(ms["inputs"]), 4), inputs_alone_us=round(alone[on], 1),
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
    add_batch_args(ap)
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
