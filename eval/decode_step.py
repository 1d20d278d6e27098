"""The serving core's decode step against the time to read the weights once.

    python -m eval.decode_step --model embedded:1b --device cuda --dtype bfloat16 [--batches 1 16 48]
                               [--prompt-tokens 64] [--steps 32] [--bandwidth-tbs TB/S] [--compile] [--cuda-graphs]
                               [--out DIR] [--tag T]
    python -m eval.decode_step --quick [--cuda-graphs]   # seconds on a CPU: the demo model, batches 1 and 4

For each batch size B, B token prompts (``--prompt-tokens`` random tokens each, none shared) are
submitted together to the engine ``generate`` runs on (``PromptCache.engine()``), greedy with EOS
ignored, and stepped until every request is decoding (its prompt prefilled). Then ``--steps`` steps
are timed one at a time (the GPU synchronized after each): the median is the decode step at B. One
more step runs under ``torch.profiler``: the aten calls it makes and the GPU kernels it launches.

A decode step on a GPU cannot be faster than reading every weight once: ``read_bytes`` (all
parameters, less the input embedding where the output layer does not share it: a step reads B rows
of it) over the memory bandwidth. The bandwidth is ``--bandwidth-tbs`` if given (an H200 is sold at
4.8 TB/s, ~4.3 reachable), else the one measured here as eval/bench_compile.py measures it (a 1 GiB
device copy on CUDA, read and write counted; a sum over 1 GiB on a CPU; reported either way).
``x_read`` is the step over that floor (the issue's bar: <= 2 at batch 48). ``--compile``: the
engine's compiled steps (piecewise CUDA graphs on a GPU) instead of eager ones. ``--cuda-graphs``:
decode steps over persistent buffers (``RunnerConfig.cuda_graphs``), each bucket captured as one
CUDA graph on a GPU and replayed (``launches`` then counts the graph's launch as one, beside the
step's copies into its buffers); on a CPU the same step runs uncaptured, with the native attention
kernel turned off (``PROMPTCACHE_NATIVE_ATTENTION=0``: the static step is the dense path's, which
the kernel's path does not take). ``static_steps`` / ``replayed``: steps of the measured batch that
ran over the static buffers / replayed a captured graph; ``device_ids``: steps whose input ids were
the last step's argmax on the device; ``graphs_captured`` / ``capture_s``: CUDA graphs captured so far
in the run and the seconds they took (``capture_error``: why a capture failed, if one did); ``static_aten``
/ ``static_launches``: the profiled step's aten
calls and launches inside the static forward (``graphs.STATIC_RANGE``): on a CPU the calls a capture
would replay as one launch, on a GPU what the replay costs (the graph's launch); ``outside_aten``: the
step's other aten calls (its inputs, the kept plan's growth, the copies into the buffers, the argmax and
sampling; without ``--cuda-graphs`` every call of the step). With ``--compile
--cuda-graphs`` the static step is compiled whole (its attention inside the graph) before it is
captured. ``loop_ms``: the same steps back to back with one synchronization at the end (on a GPU
the overlapped scheduler launches each step before reading the last one's tokens:
``ServingScheduler.overlap``; ``ahead_steps``: steps launched so in the run); ``host_syncs``: the
operations of one more step that made the host wait for the GPU (torch's synchronization debug
mode; each is printed; one is the step's read of its tokens). ``outside_ms`` (``--cuda-graphs``; median,
and least): a timed step's time outside its static forward (``CapturedSteps.forward_seconds``): on a
CPU the host work a GPU step does around its one replay (the scheduler, the rows, the plan's growth,
the copies into the buffers, the tokens' stop checks, text and outputs); on a GPU that and the wait
for the device.

Writes decode_step{--tag}.csv and .png to ``--out`` (default eval/results/) and prints each row.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time

import torch

from promptcache.engine.serving_core.graphs import STATIC_RANGE

from .bench_compile import bandwidth as measured_bandwidth, weight_bytes
from .common import RESULTS, add_model_args, pyplot, save_figure, save_table

QUICK = dict(model="embedded", batches=[1, 4], prompt_tokens=16, steps=4)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def read_bytes(model) -> int:
    """Bytes of weights a decode step reads: every parameter once (a tied matrix counted once, as
    bench_compile's limit counts them), less an input embedding the output layer does not share (a
    step gathers only its B rows)."""
    embed = model.get_input_embeddings().weight
    out = model.get_output_embeddings()
    tied = out is not None and out.weight.data_ptr() == embed.data_ptr()
    return weight_bytes(model) - (0 if tied else embed.numel() * embed.element_size())


def profiled(step, device: torch.device) -> dict:
    """aten calls and kernel launches (CUDA) of one call of ``step`` (None where the profiler fails:
    the step still runs, the timings stand)."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    try:
        with profile(activities=acts) as prof:
            step()
            sync(device)
    except RuntimeError as e:  # a build or driver without the profiler's pieces (CUPTI)
        print(f"note: torch.profiler failed ({e}): no call counts")
        step()
        return dict(aten_calls=None, launches=None, static_aten=None, outside_aten=None, static_launches=None)
    events = prof.events()
    names = [e.name for e in events]
    # the static step's forward (CapturedSteps): the calls a captured graph replays in one launch
    ranges = [(e.time_range.start, e.time_range.end, e.thread) for e in events if e.name == STATIC_RANGE]
    inside = [e for e in events if any(a <= e.time_range.start and e.time_range.end <= b and e.thread == t
                                       for a, b, t in ranges)]
    aten, static = sum(n.startswith("aten::") for n in names), sum(e.name.startswith("aten::") for e in inside)
    return dict(aten_calls=aten,
                launches=sum("LaunchKernel" in n or n == "cudaGraphLaunch" for n in names),
                static_aten=static, outside_aten=aten - static,
                static_launches=sum("LaunchKernel" in e.name or e.name == "cudaGraphLaunch" for e in inside))


def host_syncs(step, device: torch.device) -> int | None:
    """Operations of one call of ``step`` that made the host wait for the GPU (torch's synchronization
    debug mode, as warnings; None on a CPU). A decode step needs one: reading its tokens back."""
    if device.type != "cuda":
        return None
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    for w in caught:
        print(f"host sync: {w.message}")
    return len(caught)


def measure(pc, batch: int, args, seed: int) -> dict:
    """Median decode step at ``batch`` rows, and one profiled step."""
    from promptcache import SamplingParams
    from promptcache.engine.serving_core.request import Request

    engine = pc.engine()
    rng = random.Random(seed)
    vocab = min(len(pc.tokenizer), pc.model.config.vocab_size)
    warm = 2 * args.steps + 8  # steps after the prefill: timed ones (twice: one by one, back to back), the profiled
    # and synchronization-counted ones and a margin
    params = SamplingParams(max_new_tokens=warm + 8, temperature=0.0, ignore_eos=True)
    reqs = [Request(pc.prompt_spec([rng.randrange(8, vocab) for _ in range(args.prompt_tokens)]), params, pc.tokenizer)
            for _ in range(batch)]
    for r in reqs:
        engine.submit(r)
    while engine.has_incoming or any(r.prefilling or not r.token_ids for r in reqs):
        engine.step()
    for _ in range(2):  # the first decode steps of a new batch size (allocations, autotuning)
        engine.step()
    times, outside = [], []
    for _ in range(args.steps):
        sync(pc.device)
        forward = _forward_seconds(engine)
        t = time.perf_counter()
        engine.step()
        sync(pc.device)
        times.append(time.perf_counter() - t)
        outside.append(times[-1] - (_forward_seconds(engine) - forward))
    sync(pc.device)
    t = time.perf_counter()
    for _ in range(args.steps):  # back to back, one synchronization at the end: steps launched ahead run on
        engine.step()
    sync(pc.device)
    loop = (time.perf_counter() - t) / args.steps
    syncs = host_syncs(engine.step, pc.device)
    if any(r.finished for r in reqs):
        raise RuntimeError("a request finished during the timed steps: raise max_new_tokens")
    before = _static_counts(engine)
    counts = profiled(engine.step, pc.device)
    graphs = {k: v - before[k] for k, v in _static_counts(engine).items()}
    for r in reqs:
        r.cancel()
    while engine.has_work:
        engine.step()
    c = engine.captured
    captures = dict(graphs_captured=len(c.capture_seconds) if c else 0,
                    capture_s=round(sum(c.capture_seconds.values()), 3) if c else 0.0,
                    capture_error=(c.capture_error or "") if c else "")
    return dict(batch=batch, step_ms=round(1e3 * statistics.median(times), 3),
                step_ms_min=round(1e3 * min(times), 3), tok_s=round(batch / statistics.median(times), 1),
                outside_ms=round(1e3 * statistics.median(outside), 3) if engine.captured else None,
                outside_ms_min=round(1e3 * min(outside), 3) if engine.captured else None,
                loop_ms=round(1e3 * loop, 3), ahead_steps=engine.scheduler.ahead_steps, host_syncs=syncs, **counts,
                **graphs, **captures)


def _forward_seconds(engine) -> float:
    """Seconds the engine's static steps spent in their forwards so far (``CapturedSteps.forward_seconds``)."""
    return engine.captured.forward_seconds if engine.captured else 0.0


def _static_counts(engine) -> dict:
    """The engine's static-step counters so far (zeros without ``cuda_graphs``)."""
    c = engine.captured
    return dict(static_steps=c.static_steps if c else 0, replayed=c.replayed if c else 0,
                device_ids=engine.scheduler.device_id_steps)


def plot(rows, path) -> None:
    plt = pyplot()
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(5.5, 3.8))
    xs = [r["batch"] for r in rows]
    ax.plot(xs, [r["step_ms"] for r in rows], "o-", label="decode step (median)")
    ax.axhline(rows[0]["read_ms"], color="C3", ls="--", label="weights read once at the bandwidth")
    ax.set_xlabel("batch (decoding requests)")
    ax.set_ylabel("ms per step")
    ax.set_title(f"{rows[0]['model']} {rows[0]['dtype']} on {rows[0]['device_name']}", fontsize=9)
    ax.set_ylim(bottom=0)
    ax.legend(fontsize=8)
    save_figure(fig, path)


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_model_args(ap, "embedded:1b")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16, 48])
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--steps", type=int, default=32, help="timed decode steps per batch size")
    ap.add_argument("--bandwidth-tbs", type=float, default=None,
                    help="memory bandwidth in TB/s for the weights' read time (default: measured here)")
    ap.add_argument("--compile", action="store_true",
                    help="compiled steps (RunnerConfig.compile: CUDA graphs on a GPU; compiling takes minutes at first)")
    ap.add_argument("--cuda-graphs", action="store_true",
                    help="decode steps over persistent buffers, captured as CUDA graphs on a GPU (RunnerConfig."
                         "cuda_graphs); on a CPU uncaptured, with the native attention kernel off")
    ap.add_argument("--overlap", choices=("auto", "on", "off"), default="auto",
                    help="overlapped decode (tunables.OVERLAP_STEPS: auto is on a GPU only): each step launched "
                         "before the last one's tokens are read")
    ap.add_argument("--quick", action="store_true", help="the demo model, batches 1 and 4, a few steps (CPU dry run)")
    ap.add_argument("--out", default=str(RESULTS))
    ap.add_argument("--tag", default="")
    args = ap.parse_args(argv)
    if args.quick:  # quick values become the defaults; flags given explicitly still win
        ap.set_defaults(**QUICK)
        args = ap.parse_args(argv)

    if args.cuda_graphs and not str(args.device or "cpu").startswith("cuda"):
        os.environ["PROMPTCACHE_NATIVE_ATTENTION"] = "0"  # the static step is the dense path's (read when first used)
    from promptcache import EngineConfig, PromptCache, RunnerConfig
    from promptcache.models.loading import load_model

    model, tok = load_model(args.model, device=args.device, dtype=args.dtype)
    from promptcache import tunables

    tunables.OVERLAP_STEPS = {"auto": "auto", "on": True, "off": False}[args.overlap]  # read by the scheduler
    pc = PromptCache(model, tok, EngineConfig(runner=RunnerConfig(compile=args.compile,
                                                                  cuda_graphs=args.cuda_graphs)))
    device = pc.device
    measured = measured_bandwidth(device)
    bandwidth = measured if args.bandwidth_tbs is None else args.bandwidth_tbs * 1e12
    wbytes = read_bytes(model)
    read_ms = 1e3 * wbytes / bandwidth
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"{name}: weights {wbytes / 1e9:.2f} GB, bandwidth {bandwidth / 1e12:.2f} TB/s "
          f"({'measured' if args.bandwidth_tbs is None else 'given'}; measured {measured / 1e12:.2f}): "
          f"{read_ms:.3f} ms to read them once", flush=True)
    rows = []
    for i, batch in enumerate(args.batches):
        row = dict(model=args.model, dtype=args.dtype, device_name=name, compiled=args.compile,
                   cuda_graphs=args.cuda_graphs, overlap=pc.engine().scheduler.overlap,
                   **measure(pc, batch, args, seed=i),
                   weight_gb=round(wbytes / 1e9, 3), bandwidth_tbs=round(bandwidth / 1e12, 3),
                   measured_tbs=round(measured / 1e12, 3), read_ms=round(read_ms, 3))
        row["x_read"] = round(row["step_ms"] / read_ms, 2)
        row["x_read_loop"] = round(row["loop_ms"] / read_ms, 2)
        rows.append(row)
        print(json.dumps(row), flush=True)
    print(f"{'batch':>6}{'step ms':>10}{'loop ms':>10}{'tok/s':>10}{'x read':>8}{'aten':>8}{'launches':>10}{'static':>8}"
          f"{'replayed':>9}{'aten in static':>16}{'aten outside':>14}{'launches in static':>20}{'outside ms':>12}")
    for r in rows:
        print(f"{r['batch']:>6}{r['step_ms']:>10}{r['loop_ms']:>10}{r['tok_s']:>10}{r['x_read']:>8}{str(r['aten_calls']):>8}"
              f"{str(r['launches']):>10}{r['static_steps']:>8}{r['replayed']:>9}{str(r['static_aten']):>16}"
              f"{str(r['outside_aten']):>14}{str(r['static_launches']):>20}{str(r['outside_ms']):>12}")
    save_table(f"decode_step{args.tag}", rows, args.out, plot)
    return rows


if __name__ == "__main__":
    sys.exit(main() and None)
