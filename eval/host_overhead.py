"""Host overhead of the serving core's step: aten calls per forward and host time per step.

    nice -n 10 python -m eval.host_overhead [--model embedded] [--batches 1,16,48] [--native on,off]
                                            [--compile off,on] [--device cpu] [--dtype float32] [--repeats 5]

A RAG-like batch on the KV pool, driven through ``paged_forward`` (the serving core's step, without
the scheduler), through ``CompiledSteps.forward`` (``--compile on``: the serving steps of
``RunnerConfig.compile``), or through ``CapturedSteps(compile=True).forward`` (``--compile static``:
decode steps over a bucket's buffers compiled whole, attention inside the graph, as
``RunnerConfig(compile=True, cuda_graphs=True)`` runs them; its prefill steps run eagerly): ``--docs`` documents of ``--doc-len`` tokens, each encoded once at
positions 0.. (as ``DocumentStore`` encodes them) and held in the pool, and a shared system prompt of
``--system`` tokens; each of B rows reads the system prompt and ``--k`` of the documents (a
seeded random choice and order) in place, each document read shifted to where the row places it,
then its own ``--question`` tokens. The rows carry their block tables and their segments' runs of
slots (``PagedRow.own_blocks``, ``shared_runs``) as the scheduler's do. Two steps are measured per batch size B:

* ``prefill``: every row's question tokens in one step (B chunks of ``--question`` tokens);
* ``decode``: one new token per row after ``--generated`` generated tokens; every run of the step
  (warm-up, timed, profiled, planned) is the next decode step: each row one token further, as the
  scheduler builds them (the same block table and segments, its own slots one longer), so a decode
  plan kept across steps (``dense.DecodePlans``) is grown as in serving, not handed back unchanged.

For each (native kernel, compile, step, B):

* ``compiled``: whether the step ran compiled (``--compile on`` and at most
  ``max(tunables.COMPILE_BUCKETS)`` tokens; a larger step runs eagerly, as served);
* ``aten_forward``: ``aten::`` events in one step under ``torch.profiler``, nested ones counted
  (a view op's ``as_strided``, a fused attention's own transposes and allocations);
  ``aten_layer``: that over the model's layers (the step's inputs and plan, built once a step,
  included);
* ``calls_layer``: the ``aten::`` events called directly, not from inside another aten op, over the
  layers: what Python, the model's modules or a compiled graph dispatch (on a GPU each computing
  one is a kernel launch; the nested events are C++ inside one call);
* ``attn_layer``: the ``aten::`` events inside the attention function per layer, and
  ``attn_calls_layer``: those it calls directly. Eager: inside ``paged.attend`` (the new
  keys/values were written before it, by the model's cache update: 2 ``index_copy_`` a layer in
  the rest); compiled: inside the opaque attention op a layer (``promptcache::paged_attention``,
  which also writes the layer's keys and values);
* what compiled counts: inductor's generated kernels (the model's norms, rotary, activations,
  residual adds, fused) are not aten ops and are not counted; the matrix products it leaves to
  aten (``extern_kernels.mm``: the linears) are, with their nested events, as is everything in the
  attention op and everything outside the graph (the step's inputs and plan);
* ``wall_ms``: the step's wall time (plan built, forward run, logits back), median of ``--repeats``
  unprofiled runs (each after a warm-up run, which compiles a graph the first time);
* ``kernel_ms``: the time inside the step's compute kernels: on a CPU the self CPU time (its own,
  not its callees') of every ``aten::`` (or native kernel) event in the profiled step that
  computes, i.e. is not a view, an allocation or metadata (``NO_COMPUTE``: the ops that launch
  nothing on a GPU), and of inductor's generated kernels (named in the profile:
  ``cpp.enable_kernel_profile`` is set for compiled runs); on a GPU (``--device cuda``) the device
  time of the step's CUDA kernels;
* ``host_ms``: the profiled step's wall time minus ``kernel_ms``: everything else: Python (the
  plan, the model's modules, dynamo's guards), the dispatcher between ops, views and
  allocations; ``kernel_ms`` and ``host_ms`` are medians of ``--repeats`` profiled runs, both
  sides of each of the same run (the profiler's own cost, a few
  microseconds an op, lands mostly inside the ops' self times; subtracting from the unprofiled
  ``wall_ms`` went below zero on steps of thousands of small ops). On a CPU it also holds the time
  the core spends between two kernels whatever calls them: ``eval/profiler_floor.py`` measures
  1.0-2.0 ms of it for the static decode forward run from C++ with no Python (AOTInductor). On a
  GPU this is the time the host needs to issue a step, which bounds the step when it exceeds the
  kernels' device time;
* ``host_min_ms``: the least ``host_ms`` of the ``--repeats`` profiled runs (the machine's other
  load lands in host time between ops: the least is the closest to the step's own);
* host time's parts (medians; the self time of the profile's events that are not kernels):
  ``outside_ms`` (outside every recorded event: Python between ops: the step's inputs and plan,
  the model's modules when eager, the forward's own Python), ``dynamo_ms`` (the compiled
  function's guards and wrappers: TorchDynamo's cache lookup, the compiled region, AOT's
  wrappers), ``graph_ms`` (inductor's generated Python calling its kernels), ``attention_py_ms``
  (the attention function's or op's own Python, outside its aten calls), ``views_ms`` (views,
  allocations and metadata ops: ``NO_COMPUTE``); the rest of ``host_ms`` is the dispatcher's and the
  profiler's time inside computing ops' parents;
* ``around_ms`` (``--compile static``): host time outside the static forward (its profiler range,
  ``graphs.STATIC_RANGE``): the plan, the copies into the bucket, the step's Python around the
  forward: what a step whose forward is one CUDA graph replay still asks of the host (a GPU does
  not run the forward's Python, dynamo's guards or inductor's wrapper at a replay);
* ``plan_ms``: of that, the step's inputs and attention plan alone (``step_inputs``,
  ``build_plan``: once a step), median of ``--repeats``.

The native kernel is switched in a subprocess per (native, compile) setting
(``PROMPTCACHE_NATIVE_ATTENTION``: read once, when the kernel first loads): ``off`` is the path a
GPU takes. Writes ``host_overhead{--tag}.csv`` and ``.png`` (aten calls per layer and host ms per
step against B) in ``--out`` (default eval/figures).
"""

from __future__ import annotations

import argparse
import importlib
import json
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

from promptcache.engine.serving_core.graphs import STATIC_RANGE  # the forward a capture replays

from .common import add_model_args, child_command, pyplot, save_figure, save_table

FIGURES = Path(__file__).resolve().parent / "figures"
OP_PREFIXES = ("aten::", "promptcache_native::", "promptcache_ordered::")
# ops that compute nothing: views, allocations, metadata (on a GPU: no kernel launched); every other
# op's self time is kernel time
NO_COMPUTE = {f"aten::{n}" for n in (
    "view", "_unsafe_view", "_reshape_alias", "reshape", "as_strided", "transpose", "t", "permute", "expand",
    "slice", "select", "narrow", "unsqueeze", "squeeze", "alias", "unbind", "split", "chunk", "detach", "detach_",
    "lift_fresh", "empty", "empty_like", "empty_strided", "resolve_conj", "resolve_neg", "to", "result_type",
    "item", "_local_scalar_dense", "contiguous", "expand_as", "view_as", "flatten", "unflatten")}
ATTENTION_RANGE = "promptcache::attention"
COMPILED_ATTENTION_OP = "promptcache::paged_attention"  # graphs.py's opaque attention op a layer
# inductor's generated CPU kernels, as the profiler names them with ``cpp.enable_kernel_profile``
INDUCTOR_KERNEL = "cpp_fused"
AOTI_SHIM = "aoti_torch_cpu_"
# host time's parts measured in the profile (self time of these events), and ``outside_ms``: the
# time outside every recorded event (Python between them: the step's inputs and plan, the model's
# modules run eagerly, the forward's own Python)
HOST_PARTS = {
    "dynamo_ms": ("TorchDynamo Cache Lookup", "Torch-Compiled Region", "Pregraph bytecode", "AOTDispatcher"),
    "graph_ms": ("## Call CompiledFxGraph",),  # inductor's generated Python calling its kernels
    "attention_py_ms": (ATTENTION_RANGE, COMPILED_ATTENTION_OP),  # the attention function's own Python
    "views_ms": tuple(NO_COMPUTE),  # views, allocations, metadata ops
    "outside_ms": (),
}
TIMES = ("kernel_ms", "host_ms", *HOST_PARTS)


def build(args):
    """(runner, pool, documents' blocks, system prompt's blocks) with every document's states in the pool."""
    import torch

    from promptcache.engine.prefill.runner import ModelRunner
    from promptcache.engine.serving_core.kvpool import KVPool
    from promptcache.engine.serving_core.paged import PagedRow, paged_forward
    from promptcache.models.embedded import embedded_model, is_embedded
    from promptcache.models.loading import load_model

    dtype = getattr(torch, args.dtype)
    if is_embedded(args.model):
        model, tok = embedded_model(args.model, dtype=dtype, device=args.device)
    else:
        model, tok = load_model(args.model, torch_dtype=dtype, device=args.device)
    runner = ModelRunner(model, tok, torch.device(args.device))
    batch = max(args.batches)
    own = args.question + args.generated + 1 + ADVANCES
    tokens = (args.docs * args.doc_len + args.system + batch * own) * 2 + 1024
    pool = KVPool(runner.spec, runner.device, tokens, block_size=16)
    vocab = model.get_input_embeddings().num_embeddings
    rng = random.Random(args.seed)

    def encoded(n: int, start: int):
        blocks = pool.allocate(pool.blocks_for(n))
        ids = [rng.randrange(4, vocab) for _ in range(n)]
        paged_forward(runner, pool, [PagedRow(ids, list(range(start, start + n)), [], pool.slots(blocks, 0, n),
                                              logits=False)])
        return blocks

    system = encoded(args.system, 0)
    docs = [encoded(args.doc_len, 0) for _ in range(args.docs)]
    return runner, pool, docs, system, vocab


def rows_for(args, runner, pool, docs, system, vocab, batch: int, step: str):
    """The step's rows: each reads the system prompt and ``k`` documents (shifted), then its own tokens."""
    from promptcache.engine.serving_core.paged import PagedRow

    import torch

    rng = random.Random(args.seed + batch)
    rows, owned = [], []
    for r in range(batch):
        chosen = rng.sample(range(len(docs)), args.k)
        shared = [("system", pool.views(system, args.system)[0])]
        shared_pos, shared_slots, shifts = [list(range(args.system))], [pool.slots(system, 0, args.system)], [0]
        at = args.system
        for d in chosen:
            views = pool.views(docs[d], args.doc_len)
            if len(views) != 1:
                raise RuntimeError("a document's blocks are not one run (the pool is fragmented)")
            shared.append((f"doc{d}", views[0]))
            shared_pos.append(list(range(at, at + args.doc_len)))
            shared_slots.append(pool.slots(docs[d], 0, args.doc_len))
            shifts.append(at)  # stored at 0.., read at ``at``..
            at += args.doc_len
        n_own = args.question if step == "prefill" else args.question + args.generated + 1
        # a decode row's blocks hold the tokens of every step it is advanced by (``advance``)
        own_blocks = pool.allocate(pool.blocks_for(n_own + (ADVANCES if step == "decode" else 0)))
        owned.append(own_blocks)
        own_pos = list(range(at, at + n_own))
        t = args.question if step == "prefill" else 1
        ids = [rng.randrange(4, vocab) for _ in range(t)]
        rows.append(PagedRow(ids, own_pos[n_own - t:], shared, pool.slots(own_blocks, 0, n_own),
                             shared_pos=[torch.tensor(p) for p in shared_pos], own_pos=own_pos,
                             shared_slots=shared_slots, shared_shift=shifts, own_blocks=own_blocks,
                             shared_runs=[(int(s[0]), len(s)) for s in shared_slots]))
    return rows, owned


ADVANCES = 64  # decode steps a cell's rows can be advanced by


def advance(pool, rows: list, slots: dict) -> list:
    """The next decode step's rows: each the same request one token further, as the scheduler
    builds them (the same block table, segments and runs; its own slots one longer: a slice of
    ``slots[id(block table)]``, every slot its blocks hold)."""
    from promptcache.engine.serving_core.paged import PagedRow

    out = []
    for r in rows:
        n = r.own.shape[0] + 1
        if n > len(r.own_blocks) * pool.block_size:
            raise RuntimeError(f"a decode row was advanced past its {len(r.own_blocks)} blocks: raise ADVANCES")
        pos = r.own_pos + [r.own_pos[-1] + 1]
        out.append(PagedRow([r.ids[0]], pos[-1:], r.shared, slots[id(r.own_blocks)][:n], shared_pos=r.shared_pos,
                            own_pos=pos, shared_slots=r.shared_slots, shared_shift=r.shared_shift,
                            own_blocks=r.own_blocks, shared_runs=r.shared_runs))
    return out


def computes(name: str) -> bool:
    """Whether a profile event of this name is a kernel (its self time kernel time): an op that
    computes (not ``NO_COMPUTE``), an inductor kernel, or an AOTInductor forward's call of an aten
    kernel (``AOTI_SHIM``: it calls the kernel's C++ function, no ``aten::`` event of its own)."""
    return (name.startswith(OP_PREFIXES) and name not in NO_COMPUTE) or INDUCTOR_KERNEL in name \
        or name.startswith(AOTI_SHIM)


def profile_step(step, layers: int, cuda: bool = False) -> dict:
    """aten calls of one step (all, and inside the attention function) and its kernels' time: the
    leaf ops' self CPU time, or on a GPU (``cuda``) the device time of its CUDA kernels."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        t0 = time.perf_counter()
        step()
        profiled_ms = (time.perf_counter() - t0) * 1000
    events = prof.events()
    aten = [e for e in events if e.name.startswith("aten::")]

    def inside(e, names: tuple[str, ...]) -> bool:  # called (at any depth) from an event of these names
        p = e.cpu_parent
        while p is not None:
            if p.name in names:
                return True
            p = p.cpu_parent
        return False

    compute = [e for e in events if computes(e.name)]
    compute_set = set(compute)
    if cuda:
        kernel_us = sum(getattr(e, "self_device_time_total", 0) for e in events if e.device_type == DeviceType.CUDA)
    else:
        kernel_us = sum(e.self_cpu_time_total for e in compute)
    # host time's parts: the self time of the events that are not kernels, by what they are
    parts = dict.fromkeys(HOST_PARTS, 0.0)
    for e in events:
        if e in compute_set:
            continue
        part = next((k for k, names in HOST_PARTS.items() if names and e.name.startswith(names)), None)
        if part is not None:
            parts[part] += e.self_cpu_time_total / 1000
    parts["outside_ms"] = profiled_ms - sum(e.cpu_time_total for e in events if e.cpu_parent is None) / 1000
    # a static step's forward (``--compile static``): on a GPU one graph replay; what the host does
    # around it is what a captured step still pays
    static = [e for e in events if e.name == STATIC_RANGE]
    static_host_us = sum(e.cpu_time_total for e in static) - sum(e.self_cpu_time_total for e in compute
                                                                   if inside(e, (STATIC_RANGE,)))
    attn = [e for e in aten if inside(e, (ATTENTION_RANGE, COMPILED_ATTENTION_OP))]
    calls = sum(1 for e in attn if not e.cpu_parent.name.startswith(OP_PREFIXES))
    direct = sum(1 for e in aten if e.cpu_parent is None or not e.cpu_parent.name.startswith(OP_PREFIXES))
    return dict(aten_forward=len(aten), aten_layer=round(len(aten) / layers, 1),
                calls_layer=round(direct / layers, 1),
                attn_layer=round(len(attn) / layers, 1),
                attn_calls_layer=round(calls / layers, 1),
                kernel_ms=round(kernel_us / 1000, 3), host_ms=round(profiled_ms - kernel_us / 1000, 3),
                around_ms=round(profiled_ms - kernel_us / 1000 - static_host_us / 1000, 3) if static else None,
                **{k: round(v, 3) for k, v in parts.items()})


def measure(args) -> list[dict]:
    """The child: every (step, batch) with this process's kernel setting."""
    import torch

    from promptcache.engine.serving_core import paged
    from promptcache.kernels import attention as cpu_attention

    torch.set_num_threads(args.threads)
    original = paged.attend

    def attend(*a, **kw):  # marks the attention function's range for the profiler
        with torch.profiler.record_function(ATTENTION_RANGE):
            return original(*a, **kw)

    paged.attend = attend
    runner, pool, docs, system, vocab = build(args)
    native = "on" if cpu_attention.available() else "off"
    layers = runner.spec.layers
    forward, steps = (lambda pool, rows: paged.paged_forward(runner, pool, rows)), None
    if args.compile == "on":
        from promptcache.engine.serving_core.graphs import CompiledSteps

        # inductor's kernels named in the profile (kernel time, not host time); its config module
        # is underscored, reached by name as graphs.py reaches dynamo's
        inductor = importlib.import_module("torch._inductor.config")
        inductor.cpp.enable_kernel_profile = True
        steps = CompiledSteps(runner)
        forward = steps.forward
    elif args.compile == "static":
        from promptcache.engine.serving_core.graphs import CapturedSteps

        inductor = importlib.import_module("torch._inductor.config")
        inductor.cpp.enable_kernel_profile = True
        steps = CapturedSteps(runner, compile=True)
        forward = steps.forward
    out = []
    for step in ("prefill", "decode"):
        for batch in args.batches:
            rows, owned = rows_for(args, runner, pool, docs, system, vocab, batch, step)
            state = {"rows": rows}
            slots = {id(blocks): pool.slots(blocks, 0, len(blocks) * pool.block_size) for blocks in owned}

            def next_rows():  # a decode step's rows are the last step's one token further; a prefill's the same
                if step == "decode":
                    state["rows"] = advance(pool, state["rows"], slots)
                return state["rows"]

            def run(now):
                logits = forward(pool, now)
                if logits.device.type == "cuda":
                    torch.cuda.synchronize()
                return logits

            run(next_rows())  # warm-up (and, compiled, the graph's first compile)
            compiled = steps is not None and (steps.refusal(pool, rows) is None if args.compile == "static"
                                              else steps.shape_for(rows) is not None)
            walls = []
            for _ in range(args.repeats):  # (the rows built before the clock starts: measured are the step's own costs)
                now = next_rows()
                t0 = time.perf_counter()
                run(now)
                walls.append((time.perf_counter() - t0) * 1000)
            # the counts repeat exactly; the times are the median of --repeats profiled runs
            profs = [profile_step(lambda now=next_rows(): run(now), layers, cuda=runner.device.type == "cuda")
                     for _ in range(args.repeats)]
            prof = dict(profs[0], **{k: round(statistics.median(p[k] for p in profs), 3) for k in TIMES},
                        host_min_ms=min(p["host_ms"] for p in profs))
            if prof["around_ms"] is not None:
                prof["around_ms"] = round(statistics.median(p["around_ms"] for p in profs), 3)
            wall = statistics.median(walls)
            plans = []
            for _ in range(args.repeats):  # the step's inputs and plan alone (once a step, before the forward)
                now = next_rows()
                t0 = time.perf_counter()
                paged.step_inputs(pool, now)
                paged.build_plan(pool, now, keys=paged.key_rule(runner.adapter),
                                 rope=paged.query_rope(runner.adapter, now))
                plans.append((time.perf_counter() - t0) * 1000)
            out.append(dict(native=native, compile=args.compile, compiled=compiled, step=step, batch=batch,
                            tokens=sum(len(r.ids) for r in rows), **prof, wall_ms=round(wall, 3),
                            plan_ms=round(statistics.median(plans), 3)))
            print(json.dumps(out[-1]), file=sys.stderr, flush=True)
            for blocks in owned:  # the next cell's rows get fresh blocks
                pool.free(blocks)
    return out


def plot(rows: list[dict], path: Path) -> None:
    plt = pyplot()
    if plt is None:
        return
    fig, axes = plt.subplots(1, 3, figsize=(16, 4))
    for native, compile_ in sorted({(r["native"], r.get("compile", "off")) for r in rows}):
        for step, style in (("prefill", "--"), ("decode", "-")):
            cell = sorted((r for r in rows if r["native"] == native and r.get("compile", "off") == compile_
                           and r["step"] == step), key=lambda r: r["batch"])
            if not cell:
                continue
            label = f"{step}, native {native}" + {"on": ", compiled", "static": ", static compiled"}.get(compile_, "")
            for ax, key in zip(axes, ("aten_layer", "calls_layer", "host_ms")):
                ax.plot([r["batch"] for r in cell], [r.get(key, 0) for r in cell], style, marker="o", label=label)
    axes[0].set(xlabel="batch (rows a step)", ylabel="aten events per layer", title="aten events a layer (nested too)")
    axes[1].set(xlabel="batch (rows a step)", ylabel="aten calls per layer",
                title="aten calls a layer (direct: not from inside another op)")
    axes[2].set(xlabel="batch (rows a step)", ylabel="host ms per step", title="host time per step (wall - kernels)")
    for ax in axes:
        ax.set_yscale("log")  # the native kernel's per-part path is 10x the others
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
    save_figure(fig, path)


def measured_in_child(module: str, argv: list[str], native: bool, what: str) -> list[dict]:
    """The rows ``python -m module argv --child`` prints last (JSON), run in a child process with the
    native kernel on or off (``PROMPTCACHE_NATIVE_ATTENTION``, read once, when the kernel first
    loads) and whatever it sets (inductor's kernel profiling) kept out of the caller's process."""
    cmd, env = child_command(module, *argv, "--child")
    env["PROMPTCACHE_NATIVE_ATTENTION"] = "1" if native else "0"
    done = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{what} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def add_batch_args(ap) -> None:
    """The RAG-like batch's options (``build``, ``rows_for``): documents, their reads, the rows' own tokens."""
    ap.add_argument("--docs", type=int, default=16)
    ap.add_argument("--doc-len", type=int, default=64)
    ap.add_argument("--k", type=int, default=4, help="documents a row reads")
    ap.add_argument("--system", type=int, default=16, help="system prompt tokens (shared by every row)")
    ap.add_argument("--question", type=int, default=12, help="own tokens a row prefills")
    ap.add_argument("--generated", type=int, default=8, help="tokens a decode row generated before the step")


def _choices(value: str, option: str, allowed: tuple[str, ...] = ("on", "off")) -> list[str]:
    got = value.split(",")
    if not got or any(v not in allowed for v in got):
        raise SystemExit(f"{option} takes {', '.join(allowed)} (comma-separated), got {value!r}")
    return got


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_args(ap, model="embedded")
    ap.add_argument("--batches", default="1,16,48")
    ap.add_argument("--native", default="on,off", help="native CPU attention kernel settings to run: on, off")
    add_batch_args(ap)
    ap.add_argument("--compile", default="off,on",
                    help="steps run eagerly (off) and/or through CompiledSteps (on: --compile's serving steps) "
                         "and/or decode steps compiled whole over static buffers (static: --compile --cuda-graphs)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tag", default="")
    ap.add_argument("--out", default=str(FIGURES))
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    args.batches = [int(b) for b in args.batches.split(",")]
    if args.child:
        print(json.dumps(measure(args)))
        return
    rows = []
    settings = [(n, c) for c in _choices(args.compile, "--compile", ("off", "on", "static")) for n in _choices(args.native, "--native")]
    for native, compile_ in settings:
        got = measured_in_child("eval.host_overhead", [*(argv if argv is not None else sys.argv[1:]),
                                                       "--compile", compile_], native == "on",
                                f"the native={native} compile={compile_} run")
        if native == "on" and got and got[0]["native"] != "on":
            print("note: the native kernel is unavailable here: the 'on' rows ran without it")
        rows += got
    for r in rows:
        ran = ("static" if r.get("compile") == "static" else "compiled") if r["compiled"] else "eager"
        print(f"native {r['native']:3} {ran:8} {r['step']:7} B={r['batch']:3}  aten/forward {r['aten_forward']:6}  "
              f"aten/layer {r['aten_layer']:7} ({r['calls_layer']} calls)  attention aten/layer {r['attn_layer']:6} "
              f"({r['attn_calls_layer']} calls)  wall {r['wall_ms']:8.2f} ms  kernels {r['kernel_ms']:8.2f} ms  "
              f"host {r['host_ms']:8.2f} ms (least {r.get('host_min_ms', 0):.2f}; plan {r.get('plan_ms', 0):.2f}, "
              f"outside ops {r.get('outside_ms', 0):.2f}, dynamo {r.get('dynamo_ms', 0):.2f}, "
              f"graph {r.get('graph_ms', 0):.2f}, attention Python {r.get('attention_py_ms', 0):.2f} ms"
              + (f"; around the static forward {r['around_ms']:.2f} ms" if r.get("around_ms") is not None else "")
              + ")")
    save_table(f"host_overhead{args.tag}", rows, args.out, plot)


if __name__ == "__main__":
    main()
