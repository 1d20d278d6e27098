"""What the profiler's host time can show on this machine: the static decode step's forward as
``torch.compile`` runs it and as an AOTInductor forward (no Python at all) runs it.

    python -m eval.profiler_floor [--batches 2,16,48] [--repeats 20] [--forwards eager,compiled,aot]

``eval/host_overhead.py`` reads a step's host time from ``torch.profiler``: the profiled step's
wall time less its kernels' self times. This study asks how much of that is the step's own and how
much the profiler's, on the forward a GPU replays as one CUDA graph (``CapturedSteps(compile=True)``:
``graphs.static_step`` over a bucket's buffers, attention inside the graph). The batch is
``host_overhead``'s RAG-like decode step (its ``build``, ``rows_for``, ``advance``), native kernel
off (the study runs in a child process with ``PROMPTCACHE_NATIVE_ATTENTION=0``), one thread
(``--threads``). Three forwards of the same bucket's inputs:

* ``eager``: ``static_step`` run by Python, the model's modules and all;
* ``compiled``: it through ``torch.compile`` (what ``--compile --cuda-graphs`` runs: dynamo's guards,
  inductor's generated Python calling its kernels);
* ``aot``: it exported (``torch.export``, the bucket's shapes) and compiled by AOTInductor into a
  shared library whose C++ calls the kernels (the model's weights its constants, not copied); its
  host work is the C++ between kernels: what is left when no Python runs.

Each forward's logits are checked against the eager forward's (float32: within 1e-4; a forward
that differs stops the study). For each (forward, B), over ``--repeats`` runs each:

* ``plain_ms``: the least unprofiled wall time of one forward (after ``WARM`` runs; unprofiled and
  profiled runs alternate);
* ``profiled_ms``: the least wall time of one forward under the profiler (CPU activity);
  ``profiler_ms`` = ``profiled_ms - plain_ms``: what profiling adds;
* ``kernel_ms``: the kernels' self times in the profile (``host_overhead.computes``), least;
  ``host_ms``: ``host_overhead``'s host time (profiled wall less kernels), median and least;
* ``net_ms`` = ``plain_ms - kernel_ms``: the unprofiled forward's time outside its profiled
  kernels (at most the step's own host time: the profiled kernels carry some of the profiler's
  cost; at or below zero, the host work is below what the profiler resolves);
* ``events``: the profile's events (each one the profiler's own cost).

Writes ``profiler_floor{--tag}.csv`` and ``.png`` in ``--out`` (default eval/figures).
"""

from __future__ import annotations

import argparse
import importlib
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

from .common import add_model_args, pyplot, save_figure, save_table
from .host_overhead import add_batch_args, advance, build, computes, measured_in_child, rows_for

FIGURES = Path(__file__).resolve().parent / "figures"
FORWARDS = ("eager", "compiled", "aot")
TOLERANCE = 1e-4  # float32 logits of one forward run three ways
WARM = 3  # runs of a forward before it is timed


def aot_forward(runner, step, inputs: tuple, workdir: Path):
    """``step`` over ``inputs`` (their shapes fixed) as an AOTInductor forward: (call, compile seconds)."""
    import torch

    from torch._inductor import aoti_compile_and_package, aoti_load_package  # AOTInductor's documented entry points

    *tensors, swap = inputs  # swap (a bool) is a constant of the traced graph

    class Step(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.model = runner.model  # its parameters the package's constants, by these names

        def forward(self, ids, pos, layers, write, slots, mask, cos, sin):
            return step(ids, pos, layers, write, slots, mask, cos, sin, swap)

    t0 = time.perf_counter()
    program = torch.export.export(Step(), tuple(tensors), strict=False)
    path = aoti_compile_and_package(program, package_path=str(workdir / f"static_{tensors[0].shape[1]}.pt2"),
                                    inductor_configs={"aot_inductor.package_constants_in_so": False,
                                                      "cpp.enable_kernel_profile": True})
    loaded = aoti_load_package(path)
    weights = {**dict(runner.model.named_parameters()), **dict(runner.model.named_buffers())}
    constants = {name: weights[name.removeprefix("model.")] for name in loaded.get_constant_fqns()}
    loaded.load_constants(constants, check_full_update=True, user_managed=True)  # the model's own tensors
    seconds = time.perf_counter() - t0
    return (lambda: loaded(*tensors)[0]), seconds


def profile_once(call) -> tuple[float, float, int]:
    """(profiled wall ms, kernels' self ms, events) of one call under the CPU profiler."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()
        call()
        wall = (time.perf_counter() - t0) * 1000
    events = prof.events()
    return wall, sum(e.self_cpu_time_total for e in events if computes(e.name)) / 1000, len(events)


def measure(args) -> list[dict]:
    import torch

    from promptcache.engine.serving_core import paged
    from promptcache.engine.serving_core.graphs import STATIC_ATTENTION, CapturedSteps, static_step
    from promptcache.kernels import attention as cpu_attention

    if cpu_attention.available():  # the child's environment turns it off (``main``)
        raise SystemExit("the native kernel is on (PROMPTCACHE_NATIVE_ATTENTION): the static steps do not run")
    torch.set_num_threads(args.threads)
    # inductor's kernels named in the profile (kernel time, not host time); its config module is
    # underscored, reached by name as graphs.py reaches dynamo's
    importlib.import_module("torch._inductor.config").cpp.enable_kernel_profile = True
    runner, pool, docs, system, vocab = build(args)
    step = static_step(runner.model, runner.adapter.passes_position_ids)
    compiled = torch.compile(step, fullgraph=True, dynamic=True)
    out = []
    with tempfile.TemporaryDirectory(prefix="profiler_floor_") as tmp:
        for batch in args.batches:
            rows, owned = rows_for(args, runner, pool, docs, system, vocab, batch, "decode")
            slots = {id(blocks): pool.slots(blocks, 0, len(blocks) * pool.block_size) for blocks in owned}
            steps = CapturedSteps(runner, batches=(batch,))
            steps.forward(pool, advance(pool, rows, slots))  # loads the bucket's buffers
            if steps.static_steps != 1:
                raise SystemExit(f"B={batch}: the step did not run over static buffers")
            inputs = next(iter(steps.buckets.values())).inputs
            # the forward writes its rows' new keys to the same slots each run: every run computes the same
            with torch.inference_mode(), paged.attention_swapped(runner, STATIC_ATTENTION):
                calls = {"eager": lambda: step(*inputs), "compiled": lambda: compiled(*inputs)}
                seconds = {"eager": 0.0}
                t0 = time.perf_counter()
                want = calls["eager"]().clone()
                calls["compiled"]()
                seconds["compiled"] = time.perf_counter() - t0
            if "aot" in args.forwards:
                with torch.no_grad(), paged.attention_swapped(runner, STATIC_ATTENTION):
                    calls["aot"], seconds["aot"] = aot_forward(runner, step, inputs, Path(tmp))
            with torch.inference_mode(), paged.attention_swapped(runner, STATIC_ATTENTION):
                for name in args.forwards:
                    call = calls[name]
                    diff = (call().float() - want.float()).abs().max().item()
                    if not diff <= TOLERANCE:
                        raise SystemExit(f"B={batch}: the {name} forward's logits differ from the eager one's by {diff}")
                    for _ in range(WARM):
                        call()
                    plain, profiled = [], []
                    for _ in range(args.repeats):  # alternated: the machine's moments fall on both sides
                        t0 = time.perf_counter()
                        call()
                        plain.append((time.perf_counter() - t0) * 1000)
                        profiled.append(profile_once(call))
                    walls, kernels = [p[0] for p in profiled], [p[1] for p in profiled]
                    hosts = [w - k for w, k, _ in profiled]
                    row = dict(forward=name, batch=batch, plain_ms=round(min(plain), 3),
                               profiled_ms=round(min(walls), 3), profiler_ms=round(min(walls) - min(plain), 3),
                               kernel_ms=round(min(kernels), 3), host_ms=round(statistics.median(hosts), 3),
                               host_min_ms=round(min(hosts), 3), net_ms=round(min(plain) - min(kernels), 3),
                               events=profiled[0][2], max_diff=diff, build_s=round(seconds[name], 1))
                    out.append(row)
                    print(json.dumps(row), file=sys.stderr, flush=True)
            for blocks in owned:
                pool.free(blocks)
            steps.release()
    return out


def plot(rows: list[dict], path: Path) -> None:
    plt = pyplot()
    if plt is None:
        return
    fig, axes = plt.subplots(1, 2, figsize=(12, 4))
    for name in FORWARDS:
        cell = sorted((r for r in rows if r["forward"] == name), key=lambda r: r["batch"])
        if not cell:
            continue
        b = [r["batch"] for r in cell]
        axes[0].plot(b, [r["host_ms"] for r in cell], marker="o", label=f"{name}: host by the profile")
        axes[0].plot(b, [r["net_ms"] for r in cell], "--", marker="x", label=f"{name}: unprofiled wall - kernels")
        axes[1].plot(b, [r["profiler_ms"] for r in cell], marker="o", label=name)
    axes[0].axhline(0, color="grey", lw=0.5)
    axes[0].set(xlabel="batch (rows a step)", ylabel="ms", title="the static forward's host time")
    axes[1].set(xlabel="batch (rows a step)", ylabel="ms", title="what profiling adds to the forward's wall time")
    for ax in axes:
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
    save_figure(fig, path)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_args(ap, model="embedded")
    ap.set_defaults(device="cpu")  # a CPU's profile (its kernels' CPU time); on a GPU the host time is host_overhead's
    ap.add_argument("--batches", default="2,16,48")
    ap.add_argument("--forwards", default=",".join(FORWARDS), help=f"comma-separated, of {', '.join(FORWARDS)}")
    add_batch_args(ap)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tag", default="")
    ap.add_argument("--out", default=str(FIGURES))
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    args.batches = [int(b) for b in args.batches.split(",")]
    args.forwards = args.forwards.split(",")
    if not args.forwards or any(f not in FORWARDS for f in args.forwards):
        raise SystemExit(f"--forwards takes {', '.join(FORWARDS)} (comma-separated), got {','.join(args.forwards)}")
    if args.device != "cpu":
        raise SystemExit(f"--device {args.device}: this study reads a CPU's profile (kernels' CPU time); "
                         "on a GPU, eval.host_overhead --device cuda reads the kernels' device time")
    if args.child:
        print(json.dumps(measure(args)))
        return
    rows = measured_in_child("eval.profiler_floor", argv if argv is not None else sys.argv[1:], False, "the study")
    for r in rows:
        print(f"{r['forward']:8} B={r['batch']:3}  unprofiled {r['plain_ms']:7.2f} ms  profiled {r['profiled_ms']:7.2f} ms "
              f"(+{r['profiler_ms']:.2f})  kernels {r['kernel_ms']:7.2f} ms  host by the profile {r['host_ms']:5.2f} ms "
              f"(least {r['host_min_ms']:.2f})  unprofiled - kernels {r['net_ms']:6.2f} ms  events {r['events']}")
    save_table(f"profiler_floor{args.tag}", rows, args.out, plot)


if __name__ == "__main__":
    main()
