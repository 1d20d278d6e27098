"""Serving steps run as graphs: compiled (``RunnerConfig.compile``, ``--compile``: ``CompiledSteps``) and
decode steps over persistent buffers, captured as CUDA graphs (``RunnerConfig.cuda_graphs``: ``CapturedSteps``,
the section at the end).

A serving step of few tokens (decode rows, a short new-token prefill) is bound by launching
kernels, not by computing them: hundreds of small ops per layer, each dispatched from Python.
``CompiledSteps.forward`` runs such a step through ``torch.compile`` of the stock model instead
of eagerly, with the same inputs and the same answer as ``paged.paged_forward``:

* **Shapes.** A step of at most ``max(tunables.COMPILE_BUCKETS)`` tokens is compiled; a larger
  one runs eagerly (it is bound by its matrix products, where compiling gains nothing).
  - On CPU the graph has **symbolic sizes** (``dynamic=True``): a step of n tokens and r logits
    rows runs as it is, unpadded, and dynamo keeps one graph for one token, one for 2 or more
    with one logits row, one for 2 or more rows (it specializes sizes 0 and 1): three compiles in
    all, where one graph per bucket pair would be dozens, each a stall of seconds on first use.
    ``warm`` compiles the three at a server's start.
  - With CUDA graphs (``pad``, the default on CUDA) shapes are static by **bucketing**: a step
    runs as the bucket pair (N, R) >= (n, r); ids and position IDs are padded (pad tokens at
    position 0, written nowhere, attending to nothing, their outputs dropped), the logits rows
    by repeating the last. One graph per bucket pair, compiled lazily (logged with its time).
* **Guards.** The compiled model's modules do not change after compiling (packing happens
  before), so dynamo is told not to guard on them (``torch.compiler``'s
  ``skip_guard_on_all_nn_modules_unsafe``): checking every parameter's guards cost most of what
  compiling saved (eval/results/compile.md). Inputs' shapes and dtypes are still guarded. The
  model's Python floats (norm epsilons, scales) are specialized as constants, not turned into
  tensors before every step (``specialize_float``). Dynamo
  keeps graphs per code object, so without those guards two models of one class would share a
  graph (the second then ran with the first one's dtype and constants): each ``CompiledSteps``
  compiles a step function with a code object of its own (``_own_code``).
* **The pool stays an input.** Attention is one opaque custom op per layer
  (``promptcache::paged_attention``) that writes the layer's new keys/values into their pool
  slots (stacked inside the graph, written in one copy) and reads the pool as the step's plan
  says (``paged.attend``: without the native CPU kernel, as on a GPU, dense.py's one padded call
  over every row's keys gathered by slot, ~12 aten calls a layer at decode; with it, shared
  segments in place, own tokens, log-sum-exp merges). The plan (block tables, segments) and the position IDs are
  the step's data, never baked into a graph, so Prompt Cache's positions are untouched and one
  graph serves every request mix of its bucket.
* **CUDA graphs on a GPU.** On CUDA the model is compiled with inductor's CUDA graphs (what
  ``mode="reduce-overhead"`` sets) and its graph partition (``compile_options``): everything
  between two attention ops is captured as a CUDA graph per bucket and replayed; the attention
  op is tagged ``cudagraph_unsafe`` and runs eagerly between them (its work depends on the step's plan). Piecewise capture, as vLLM does. (How to
  measure it: eval/results/compile.md.)
* **Cached on disk.** Inductor keeps the compiled kernels in its own cache folder
  (``TORCHINDUCTOR_CACHE_DIR``, by default ``/tmp/torchinductor_<user>``: set it to a lasting
  folder to keep them across reboots): a restart compiles a bucket from that cache in a
  fraction of the first time.

Exactness: compiled and eager steps agree within float32 rounding (fused elementwise kernels
round in another order): tests/engine/test_graphs.py checks logits within 1e-4 and equal greedy
tokens for every family the pool serves.

On a CPU the linears, reading the weights, are most of a decode step, so a compiled step is only
a little faster than the eager one, and each graph costs seconds of compiling at the first start
(less from inductor's cache); hence opt-in. Figures: eval/results/compile.md.

**Captured decode steps** (``CapturedSteps``, ``RunnerConfig.cuda_graphs``, ``--cuda-graphs``).

A decode step on a GPU is bound by launching kernels, not by running them: ~840 launches a step on a
1B model, each dispatched from Python, 57x the time to read the weights at batch 48
(eval/results/cuda_checks_2026-11-28.md). A CUDA graph replays a recorded step's kernels in one
launch, but only over the same memory: every input of the step must be a tensor that stays where it
is. ``CapturedSteps.forward`` runs a step of decode rows as such a step:

* **Buckets.** The rows are padded up to a batch size of ``tunables.GRAPH_BATCHES`` (B) and each
  row's keys up to a multiple of ``tunables.GRAPH_WIDTH`` (W); a bucket is (B, W, the rotation of
  shifted keys: none, or its channels). Each bucket owns its buffers: the input ids and position
  IDs [1, B], the pool slots the new keys and values go to [B], the dense plan of the step
  (``dense.DenseStep``: the gathered key slots [B * W], the mask [B, 1, 1, W], the rotation of
  shifted keys cos/sin [B, W, r]) and, once it has run, the logits [1, B, V] the forward returned.
* **A step** builds its plan as the eager dense path does (``paged.build_plan``: a decode batch's
  plan is kept and grown across steps, ``dense.DecodePlans``), copies the rows' ids (the last
  step's argmax where the scheduler kept it on the device: ``PagedRow.sampled``, a device copy),
  positions, write slots and plan into the bucket's buffers, and runs the model's forward over
  those buffers alone, through the same attention (``paged.attend`` on a plan holding the bucket's
  ``DenseStep``: ``dense.attend_dense``). Pad rows (B above the rows) read token 0 at position 0,
  write their keys to a scratch slot (one block of the pool, held while this object serves it)
  and attend to that slot alone (finite values; their logits are dropped); pad keys (W above a
  row's keys) are masked. A bucket's buffers outside the real rows are reset only when its
  (rows, keys) changed since its last step.
* **On a GPU** a bucket's first step runs once eagerly (allocations settle), is captured with
  ``torch.cuda.graph`` (one memory pool shared by every bucket's graph: steps replay one at a
  time) and replayed; later steps copy their inputs in and replay (the logits cloned out: the
  next replay overwrites them). Captured lazily, only the buckets that occur, each logged with the
  time it took; at most ``tunables.GRAPHS_KEPT`` kept (least recently used dropped).
  **On a CPU** the identical step runs uncaptured (the same buffers and calls, no replay): how
  its exactness is tested here (tests/engine/test_captured_graphs.py).

**Compiled whole** (``compile=True``; the engine passes ``RunnerConfig.compile``, so ``--compile
--cuda-graphs`` together): the static forward is traced by ``torch.compile`` as a function of the
bucket's buffers and the pool's layers (``static_step``), its attention inside the graph
(``static_attention``, registered as ``STATIC_ATTENTION``: the layer's new keys and values written to
their slots, every row's keys gathered, the shifted ones rotated, one fused attention under the
mask; what ``dense.attend_dense`` computes for decode rows, as plain tensor calls inductor fuses with
the model's norms and rotary). Each layer's pool buffer is an input of its own: written in place (a
single buffer for every layer was cloned by the graph at every layer after the first). Sizes are
symbolic: one graph for every bucket of 2 rows or more and one for a single row, per rotation
(``compile_seconds``). On a GPU the compiled step's kernels are what a capture records (fewer and
fused, where the eager step's are the model's every op); on a CPU it runs as it is: the eager
attention's Python (the largest part of a decode step's host time) is gone, its ops are the
graph's (eval/results/host_overhead.md).

What a static step cannot express takes the step's other forward (``fallback``: the compiled or
eager ``paged_forward``), logged at debug level with the reason: a prefill row or one asking no
logits, a row with key limits (selective recompute), more rows than the largest bucket, a model
whose attention reads key positions (ALiBi, a sliding window some row reaches past), the native
CPU kernel's path (it reads stored tensors in place), segments held outside the pool, a pool
with no block free for the scratch slot. Never a wrong answer: the static step computes what
``paged_forward`` computes on the dense path (float32 logits within 1e-4, the same greedy tokens).
"""

from __future__ import annotations

import itertools
import logging
import math
import os
import threading
import time
import types
from collections import OrderedDict
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from transformers import AttentionInterface

from ... import tunables
from ...errors import ConfigError
from ...kernels import attention as cpu_attention
from ...tunables import COMPILE_BUCKETS
from .dense import DenseStep, on_device, rotate
from .kvpool import KVPool
from .paged import PagedCache, PagedRow, StepPlan, attend, attention_swapped, build_plan, key_rule, paged_forward, \
    paged_refusal, query_rope, step_ids, step_inputs, step_places

log = logging.getLogger(__name__)

__all__ = ["COMPILED_ATTENTION", "STATIC_ATTENTION", "STATIC_RANGE", "CapturedSteps", "CompiledSteps", "StaticBucket",
           "bucket_for", "compile_options", "compile_refusal", "static_step"]

COMPILED_ATTENTION = "promptcache_compiled"
STATIC_ATTENTION = "promptcache_static"  # the attention of a static step compiled whole (traced into its graph)
# the profiler range around a static step's forward (CapturedSteps): what a captured graph replays
STATIC_RANGE = "promptcache.static_forward"


def bucket_for(n: int, buckets: tuple[int, ...] = COMPILE_BUCKETS) -> int | None:
    """The smallest bucket holding ``n`` (None: larger than every bucket)."""
    for b in buckets:
        if n <= b:
            return b
    return None


# -- the attention op ---------------------------------------------------------------------------

class _Step:
    """What the attention op of the step running on this thread reads: the plan, the pool
    slots of the n real tokens, n."""

    def __init__(self, plan: StepPlan, write: torch.Tensor, n: int):
        self.plan, self.write, self.n = plan, write, n


_LOCAL = threading.local()  # .step: the running step's _Step (a compiled forward runs on its caller's thread)
# torch's tag for ops a CUDA graph must not capture (inductor partitions the graph around them);
# torch.Tag is public, the tag is newer than some builds
_UNSAFE = getattr(torch.Tag, "cudagraph_unsafe", None)


@torch.library.custom_op("promptcache::paged_attention", mutates_args=(),
                         tags=(_UNSAFE,) if _UNSAFE is not None else ())
def _paged_attention_op(query: torch.Tensor, kv: torch.Tensor, layer: int, scaling: float) -> torch.Tensor:
    """query [1, Hq, N, D], kv [2, Hk, N, D] (keys and values of one layer, stacked inside the
    compiled graph) -> [1, N, Hq, D]: the first n tokens' keys/values go to their pool slots (one
    copy), their queries attend as the plan says, the pad tokens' outputs are zero."""
    step: _Step = _LOCAL.step
    n, big = step.n, query.shape[2]
    layer_kv = step.plan.pool.layers[layer]  # [2, Hk, S, D]
    if n < big:
        kv, query = kv[:, :, :n], query[:, :, :n]
    layer_kv.index_copy_(2, step.write, kv if kv.dtype == layer_kv.dtype else kv.to(layer_kv.dtype))
    out = attend(step.plan, layer, query, scaling if scaling > 0 else None)  # [1, n, Hq, D]
    if n == big:  # no padding
        return out.contiguous()
    full = query.new_zeros((1, big, query.shape[1], query.shape[3]))
    full[:, :n] = out
    return full


@_paged_attention_op.register_fake
def _(query, kv, layer, scaling):
    return query.new_empty((query.shape[0], query.shape[2], query.shape[1], query.shape[3]))


def compiled_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """The attention function of compiled steps (registered as ``COMPILED_ATTENTION``): keys and
    values [1, Hk, N, D] stacked in the graph (fused there, not an op of its own) for one write."""
    kv = torch.stack((key[0], value[0]))
    return torch.ops.promptcache.paged_attention(query, kv, module.layer_idx,
                                                 float(scaling) if scaling is not None else 0.0), None


AttentionInterface.register(COMPILED_ATTENTION, compiled_attention)


def static_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, pc_static=None, **kwargs):
    """The attention of a static step compiled whole (registered as ``STATIC_ATTENTION``; traced into the
    step's graph, no op of its own): the layer's new keys and values [1, Hk, B, D] written to their
    pool slots, then what ``dense.attend_dense`` computes for a decode step, as plain tensor calls
    inductor fuses: every row's W keys gathered by slot, shifted keys rotated, one fused attention
    under the mask. ``pc_static``: (the pool's layers, each [2, Hk, S, D] and an input of its own: a
    graph mutating one buffer of every layer cloned it at every layer after the first; write slots
    [B], key slots [B * W],
    mask [B, 1, 1, W], cos, sin [B, W, r] or None, swap)."""
    layers, write, slots, mask, cos, sin, swap = pc_static
    kv = layers[module.layer_idx]  # [2, Hk, S, D]
    _, hk, _, d = kv.shape
    _, hq, b, _ = query.shape
    w = mask.shape[-1]
    kv.index_copy_(2, write, torch.stack((key[0], value[0])).to(kv.dtype))
    keys, values = kv.index_select(2, slots).float().view(2, hk, b, w, d).unbind(0)  # [Hk, B, W, D] each
    if cos is not None:
        keys = rotate(keys, cos, sin, swap)
    q = query.view(hk, hq // hk, b, d).float().permute(2, 0, 1, 3)  # [B, Hk, G, D]
    scale = scaling if scaling is not None else 1 / math.sqrt(d)
    out = torch.nn.functional.scaled_dot_product_attention(q, keys.transpose(0, 1), values.transpose(0, 1),
                                                           attn_mask=mask, scale=scale)  # [B, Hk, G, D]
    return out.reshape(1, b, hq, d).to(query.dtype), None


AttentionInterface.register(STATIC_ATTENTION, static_attention)


@contextmanager
def _stepping(step: _Step):
    _LOCAL.step = step
    try:
        yield
    finally:
        _LOCAL.step = None


# -- compiled steps -----------------------------------------------------------------------------

def compile_refusal(runner) -> str | None:
    """Why steps of this runner's model cannot be compiled (None: they can)."""
    why = paged_refusal(runner)
    return None if why is None else f"compiled steps build on the paged pool, which this model cannot use: {why}"


def compile_options(device: torch.device) -> dict:
    """torch.compile's options for ``device``: no guards on the model's modules (where torch has
    the filter); on CUDA, CUDA graphs (what ``mode="reduce-overhead"`` sets; torch.compile
    takes a mode or options, not both) captured piecewise around the attention operations
    (graph partition)."""
    options = {}
    skip = getattr(torch.compiler, "skip_guard_on_all_nn_modules_unsafe", None)  # torch >= 2.8
    if skip is not None:
        options["guard_filter_fn"] = skip
    if device.type == "cuda":
        options.update({"triton.cudagraphs": True, "graph_partition": True})
    return options


_steps_made = itertools.count()


def _own_code(step, name: str):
    """``step`` (a closure over one model) as a function whose code object is its alone: dynamo caches
    compiled graphs on code objects and, not guarding the modules, would hand a graph traced for
    one model to another of the same class (seen: a bfloat16 model given a float32 one's graph)."""
    code = step.__code__.replace(co_name=f"{name}_{next(_steps_made)}")
    return types.FunctionType(code, step.__globals__, code.co_name, None, step.__closure__)


def _own_step(model):
    """``model(**kwargs)`` as a function of this model's alone (``_own_code``)."""
    def step(**kwargs):
        return model(**kwargs)

    return _own_code(step, "compiled_step")


def static_step(model, passes_position_ids: bool):
    """The static step's forward as a function of its buffers alone (``StaticBucket.inputs``; a code
    object of its own, ``_own_code``): logits [1, B, V]; attention is ``static_attention`` (the
    caller swaps it in)."""
    def step(ids, pos, layers, write, slots, mask, cos, sin, swap):
        kwargs = {"position_ids": pos} if passes_position_ids else {}
        return model(input_ids=ids, use_cache=False, logits_to_keep=0,
                     pc_static=(layers, write, slots, mask, cos, sin, swap), **kwargs).logits

    return _own_code(step, "static_step")


def _keep_graphs(limit: int) -> None:
    """Each bucket pair is a recompile of the same model code; dynamo keeps 8 per code object by
    default and then runs eagerly. Raised to ``limit`` (dynamo's documented setting, reached by
    name: its module path is underscored)."""
    config = getattr(torch, "_dynamo").config
    for name in ("recompile_limit", "cache_size_limit"):  # the newer name, then the older
        if hasattr(config, name):
            setattr(config, name, max(getattr(config, name), limit))
            return


def _specialize_floats() -> None:
    """Python floats the traced model reads (its norms' epsilons, attention scales) become graph
    constants, not tensor inputs: dynamo's default (``specialize_float`` off) builds a tensor from
    each of them before every step (three aten calls apiece, ten a step on a 4-layer model). They
    are the model's constants, fixed after compiling (dynamo's documented setting, reached by name
    as ``_keep_graphs`` does)."""
    config = getattr(torch, "_dynamo").config
    if hasattr(config, "specialize_float"):
        config.specialize_float = True


class CompiledSteps:
    """``forward(pool, rows)``: ``paged.paged_forward`` with steps of at most ``max(buckets)``
    tokens compiled. ``pad``: steps padded to bucket pairs (static shapes; default on CUDA,
    where CUDA graphs need them), else run unpadded through symbolic sizes (the default on CPU).
    ``compile_seconds``: graph -> seconds its first step took (tracing and compiling, or loading
    from the disk cache); a graph is a bucket pair (N, R) when padding, else (1, 1), (2, 1) or
    (2, 2): one token; 2 or more with one logits row; 2 or more rows."""

    def __init__(self, runner, buckets: tuple[int, ...] = COMPILE_BUCKETS, pad: bool | None = None):
        why = compile_refusal(runner)
        if why is not None:
            raise ConfigError(f"RunnerConfig.compile (--compile): {why}")
        if not buckets or list(buckets) != sorted(set(buckets)) or buckets[0] < 1:
            raise ConfigError(f"compile buckets must be increasing positive sizes, got {buckets!r}")
        self.runner, self.buckets = runner, tuple(buckets)
        # inductor's own cache folder (it sets the variable to its default when torch.compile loads)
        self.cache_dir = os.environ.get("TORCHINDUCTOR_CACHE_DIR", "inductor's cache folder")
        _keep_graphs(2 * len(self.buckets) ** 2)
        _specialize_floats()
        self._cuda = runner.device.type == "cuda"
        self.pad = self._cuda if pad is None else pad
        self._fn = torch.compile(_own_step(runner.model), fullgraph=True, dynamic=not self.pad,
                                 options=compile_options(runner.device))
        self.compile_seconds: dict[tuple[int, int], float] = {}
        self.compiled_steps = 0
        self.eager_steps = 0

    def shape_for(self, rows: list[PagedRow]) -> tuple[int, int] | None:
        """The (tokens, logits rows) a step runs as, padded or not; None: it runs eagerly."""
        n = sum(len(r.ids) for r in rows)
        k = max(1, sum(1 for r in rows if r.logits))
        if n > self.buckets[-1]:
            return None
        return (bucket_for(n, self.buckets), bucket_for(k, self.buckets)) if self.pad else (n, k)

    def graph_for(self, shape: tuple[int, int]) -> tuple[int, int]:
        """The compiled graph a step of this shape runs in (``compile_seconds``' keys)."""
        return shape if self.pad else (min(shape[0], 2), min(shape[1], 2))

    def forward(self, pool: KVPool, rows: list[PagedRow]) -> torch.Tensor:
        """Logits [k, V] of the rows with ``logits`` set, in order (as ``paged_forward``)."""
        shape = self.shape_for(rows)
        if shape is None:
            self.eager_steps += 1
            return paged_forward(self.runner, pool, rows)
        big, rows_bucket = shape
        ids, pos, write, ends = step_inputs(pool, rows)
        n, dev = ids.shape[1], pool.buf.device
        if big > n:
            ids = torch.nn.functional.pad(ids, (0, big - n))  # [1, N]: pad token 0
            pos = torch.nn.functional.pad(pos, (0, big - n))  # pads at position 0 (they attend to nothing)
        last = ends[-1] if ends else n - 1
        keep = on_device(ends + [last] * (rows_bucket - len(ends)), dev)  # [R]
        kwargs = {"position_ids": pos} if self.runner.adapter.passes_position_ids else {}
        step = _Step(build_plan(pool, rows, keys=key_rule(self.runner.adapter), rope=query_rope(self.runner.adapter, rows)), write, n)
        graph = self.graph_for(shape)
        first = graph not in self.compile_seconds
        if first:
            log.info("compiling the step of %s tokens, %s logits rows (once; kept in %s) ...", *self._sizes(graph),
                     self.cache_dir)
        t0 = time.perf_counter()
        with torch.inference_mode(), self.runner.lock, attention_swapped(self.runner, COMPILED_ATTENTION), \
                _stepping(step):
            out = self._fn(input_ids=ids, use_cache=False, logits_to_keep=keep, **kwargs)
        if first:
            self.compile_seconds[graph] = time.perf_counter() - t0
            log.info("compiled the step of %s tokens, %s logits rows in %.1f s", *self._sizes(graph),
                     self.compile_seconds[graph])
        self.compiled_steps += 1
        logits = out.logits[0, : len(ends)]
        # a CUDA graph's outputs live in its memory pool and the next replay overwrites them: a
        # prefill's logits are kept past this step
        return logits.clone() if self._cuda else logits

    def _sizes(self, graph: tuple[int, int]) -> tuple[str, str]:
        return tuple(str(x) if self.pad or x == 1 else f"{x} or more" for x in graph)

    def warm(self, sizes: tuple[int, ...] | None = None) -> None:
        """Compile now (a server's start), not on first use: the decode steps of these batch
        sizes; by default batch 1 when padding, else every graph (decode rows of 1 and 2, and
        one request's 2-token chunk)."""
        spec, dev = self.runner.spec, self.runner.device
        pool = KVPool(spec, dev, tokens=max(64, 16 * max(sizes or (2,))), block_size=16)  # throwaway
        steps = [[1] * b for b in (sizes or ((1,) if self.pad else (1, 2)))]
        if sizes is None and not self.pad:
            steps.append([2])
        for lengths in steps:
            blocks = [pool.allocate(1) for _ in lengths]
            self.forward(pool, [PagedRow([0] * t, list(range(t)), [], pool.slots(own, 0, t))
                                for t, own in zip(lengths, blocks)])
            for own in blocks:
                pool.free(own)


# -- decode steps over persistent buffers, captured as CUDA graphs ---------------------------------

@dataclass(eq=False)
class StaticBucket:
    """One bucket's persistent buffers (see the module's docstring) and, on a GPU, its graph."""

    key: tuple  # (B, W, rotation: None or (r, swap))
    ids: torch.Tensor  # [1, B]
    places: torch.Tensor  # [2, B]: ``pos`` and ``write``, filled by one copy (``paged.step_places``)
    pos: torch.Tensor  # [1, B] (a view of ``places``)
    write: torch.Tensor  # [B] pool slot each row's new key and value go to (a view of ``places``)
    dense: DenseStep  # rows B, queries 1, width W: slots [B * W], mask [B, 1, 1, W], cos / sin [B, W, r]
    plan: StepPlan  # the plan every layer reads: ``dense`` over the pool
    logits: torch.Tensor | None = None  # [1, B, V] the forward's (on a GPU: the graph's output)
    graph: object | None = None  # torch.cuda.CUDAGraph once captured
    last: tuple[int, int] | None = None  # (rows, keys a row) of its last step: the real region
    # views of the real region of ``last`` (ids, places, slots [b, w], mask [b, w], cos, sin), made when it
    # moves: a step's copies into the buffers are one op each, whatever the rows
    region: tuple | None = None
    # the last step's kept plan (``dense.DecodePlans`` grows it in place) and its slots and mask as [b, w]
    source: tuple | None = None
    steps: int = 0

    @property
    def inputs(self) -> tuple:
        """What ``static_step``'s function takes: (ids, pos, the pool's layers, write, slots, mask, cos,
        sin, swap)."""
        d = self.dense
        return self.ids, self.pos, self.plan.pool.layers, self.write, d.slots, d.mask, d.cos, d.sin, d.swap


class CapturedSteps:
    """``forward(pool, rows)``: a step's logits [k, V] as ``paged.paged_forward`` gives them; decode
    steps over persistent buffers (captured as CUDA graphs on a GPU), every other step through
    ``fallback(pool, rows)`` (default ``paged_forward``). Counters: ``static_steps`` (steps run over
    a bucket's buffers), ``replayed`` (of them, replays of a captured graph), ``fallback_steps``;
    ``forward_seconds``: time spent in the static steps' forwards (on a GPU launching the replays, on
    a CPU running them: a step's time less this is its host work around the forward);
    ``capture_seconds``: bucket key -> seconds its capture took (warm run and capture). A capture
    that fails (an operation that waits for the host, say) is logged as a warning and the static
    steps run uncaptured from then on (``capture_error`` says why)."""

    def __init__(self, runner, fallback=None, batches: tuple[int, ...] | None = None, width: int | None = None,
                 kept: int | None = None, compile: bool = False):
        batches = tuple(batches if batches is not None else tunables.GRAPH_BATCHES)
        width = width if width is not None else tunables.GRAPH_WIDTH
        kept = kept if kept is not None else tunables.GRAPHS_KEPT
        if not batches or list(batches) != sorted(set(batches)) or batches[0] < 1:
            raise ValueError(f"static step batch sizes must be increasing positive sizes, got {batches!r}")
        if isinstance(width, bool) or not isinstance(width, int) or width < 1:
            raise ValueError(f"static step key width must be an integer >= 1, got {width!r}")
        self.runner, self.batches, self.width, self.kept = runner, batches, width, max(1, kept)
        self.fallback = fallback or (lambda pool, rows: paged_forward(runner, pool, rows))
        self.capture = runner.device.type == "cuda"
        self.capture_error: str | None = None  # why a capture failed (static steps then run uncaptured)
        adapter = runner.adapter
        # attention computed inline (ALiBi families, Falcon) or reading key positions: never a static step
        self.never = "the model's attention reads key positions (ALiBi)" if adapter.positional == "alibi" \
            else "the model computes attention inline" if adapter.inline_attention else None
        if self.never is not None:
            log.info("static decode steps (cuda_graphs) do not apply to this model: %s; its steps run as before",
                     self.never)
        self.buckets: OrderedDict[tuple, StaticBucket] = OrderedDict()
        self.pool: KVPool | None = None
        self.scratch: list[int] | None = None  # the block whose first slot pad rows write to
        self._mempool = None
        self.static_steps = self.replayed = self.fallback_steps = 0
        self.forward_seconds = 0.0
        self.capture_seconds: dict[tuple, float] = {}
        # the static forward compiled whole, attention traced in (``static_attention``): one graph
        # (symbolic rows and keys) whose kernels a capture records; None: the eager forward
        self._compiled = None
        if compile and self.never is None:
            _keep_graphs(8)
            _specialize_floats()
            options = {k: v for k, v in compile_options(runner.device).items()
                       if k not in ("triton.cudagraphs", "graph_partition")}  # the capture is this class's own
            self._compiled = torch.compile(static_step(runner.model, adapter.passes_position_ids), fullgraph=True,
                                           dynamic=True, options=options)
        self.compile_seconds: dict[tuple, float] = {}  # graph (rows 1 or more, rotation) -> its first step's seconds

    @property
    def compiled(self) -> bool:
        """Whether the static steps run compiled whole (``compile=True`` and a model they apply to)."""
        return self._compiled is not None

    # -- the step -------------------------------------------------------------------------------
    def forward(self, pool: KVPool, rows: list[PagedRow]) -> torch.Tensor:
        why = self.refusal(pool, rows)
        plan = None
        if why is None:
            adapter = self.runner.adapter
            plan = build_plan(pool, rows, keys=key_rule(adapter), rope=query_rope(adapter, rows))
            why = self._plan_refusal(plan, pool)
        if why is not None:
            log.debug("a step of %d rows runs without the static buffers: %s", len(rows), why)
            self.fallback_steps += 1
            return self.fallback(pool, rows)
        dense: DenseStep = plan.dense
        bucket = self._bucket(pool, dense)
        self._load(bucket, pool, rows, dense)
        t0 = time.perf_counter()
        logits = self._replay(bucket)
        self.forward_seconds += time.perf_counter() - t0
        self.static_steps += 1
        bucket.steps += 1
        out = logits[0, : dense.rows]
        # a graph's output lives in its memory pool and the next replay overwrites it
        return out.clone() if self.capture else out

    def refusal(self, pool: KVPool, rows: list[PagedRow]) -> str | None:
        """Why these rows cannot run as a static step, from the rows alone (None: they may)."""
        if self.never is not None:
            return self.never
        if not rows:
            return "no rows"
        if any(len(r.ids) != 1 or not r.logits for r in rows):
            return "a prefill row (more than one token, or no logits)"
        if any(r.shared_limits is not None and any(x is not None for x in r.shared_limits) for r in rows):
            return "a row with key limits (selective recompute)"
        if len(rows) > self.batches[-1]:
            return f"{len(rows)} rows, more than the largest bucket ({self.batches[-1]})"
        if cpu_attention.gathers(pool.buf):
            return "the native CPU kernel reads this pool (its path, not the dense one)"
        return None

    def _plan_refusal(self, plan: StepPlan, pool: KVPool) -> str | None:
        if plan.keys is not None:
            return "a sliding window some row reaches past"
        if plan.dense is None:
            return "no dense plan (the padded scores would pass tunables.DENSE_MAX)"
        if plan.segments or plan.limited:
            return "segments held outside the pool (a store tier's tensors)"
        d = plan.dense
        if d.queries != 1 or d.qidx is not None or d.back is not None:
            return "queries padded within a row"
        b, w = bucket_for(d.rows, self.batches), self._width(d.width)
        if pool.buf.shape[2] * b * w > tunables.DENSE_MAX:
            return f"the bucket ({b} rows x {w} keys) would pass tunables.DENSE_MAX"
        if not self._bind(pool):
            return "no pool block free for the pad rows' scratch slot"
        return None

    def _width(self, w: int) -> int:
        return self.width * math.ceil(w / self.width)

    def _bind(self, pool: KVPool) -> bool:
        """Serve ``pool`` (one at a time: another pool drops the buckets, their buffers read the
        old one's layers) and hold its scratch block; False where no block is free for it."""
        if pool is not self.pool:
            if self.pool is not None:
                log.info("static decode steps: a new KV pool, %d buckets dropped", len(self.buckets))
                self.release()
            self.pool = pool
        if self.scratch is None:
            self.scratch = pool.allocate(1)
        return self.scratch is not None

    def release(self) -> None:
        """Drop every bucket (and graph) and give the scratch block back to its pool."""
        self.buckets.clear()
        if self.pool is not None and self.scratch is not None:
            self.pool.free(self.scratch)
        self.pool, self.scratch = None, None

    @property
    def scratch_slot(self) -> int:
        return self.scratch[0] * self.pool.block_size

    # -- buffers --------------------------------------------------------------------------------
    def _bucket(self, pool: KVPool, dense: DenseStep) -> StaticBucket:
        b, w = bucket_for(dense.rows, self.batches), self._width(dense.width)
        rot = None if dense.cos is None else (dense.cos.shape[-1], dense.swap)
        key = (b, w, rot)
        bucket = self.buckets.get(key)
        if bucket is not None:
            self.buckets.move_to_end(key)
            return bucket
        while len(self.buckets) >= self.kept:
            old, _ = self.buckets.popitem(last=False)
            log.info("static decode steps: bucket %s dropped (%d kept at most)", old, self.kept)
        dev, scratch = pool.buf.device, self.scratch_slot
        long = dict(dtype=torch.long, device=dev)
        slots = torch.full((b * w,), scratch, **long)
        mask = torch.full((b, 1, 1, w), float("-inf"), dtype=torch.float32, device=dev)
        cos = sin = None
        if rot is not None:
            cos = torch.zeros((b, w, rot[0]), dtype=torch.float32, device=dev)
            sin = torch.zeros_like(cos)
        step = DenseStep(b, 1, w, slots, mask, None, None, cos, sin, dense.swap if rot else False)
        places = torch.stack((torch.zeros(b, **long), torch.full((b,), scratch, **long)))
        bucket = StaticBucket(key, torch.zeros((1, b), **long), places, places[:1], places[1], step,
                              StepPlan(pool, None, dense=step))
        self.buckets[key] = bucket
        log.debug("static decode steps: bucket %s made", key)
        return bucket

    def _load(self, bucket: StaticBucket, pool: KVPool, rows: list[PagedRow], dense: DenseStep) -> None:
        """The step's inputs and plan copied into ``bucket``'s buffers (device copies; the ids are the
        last step's argmax on the device where the scheduler kept it): one host tensor and four to
        six copies, whatever the rows."""
        b, w = dense.rows, dense.width
        big, wide = bucket.key[0], bucket.key[1]
        step = bucket.dense
        if bucket.last != (b, w):  # the real region moved: everything outside it reset to padding
            slots, mask = step.slots.view(big, wide), step.mask.view(big, wide)
            scratch = self.scratch_slot
            bucket.ids[:, b:].zero_()
            bucket.pos[:, b:].zero_()
            bucket.write[b:].fill_(scratch)
            slots[b:].fill_(scratch)
            mask[:, w:].fill_(float("-inf"))
            mask[b:].fill_(float("-inf"))
            mask[b:, 0] = 0.0  # a pad row attends to its own key at the scratch slot alone
            rot = (step.cos[:b, :w], step.sin[:b, :w]) if step.cos is not None else (None, None)
            bucket.region = (bucket.ids[:, :b], bucket.places[:, :b], slots[:b, :w], mask[:b, :w], *rot)
            bucket.last = (b, w)
        if bucket.source is None or bucket.source[0] is not dense:  # a plan built anew, not the kept one grown
            bucket.source = (dense, dense.slots.view(b, w), dense.mask.view(b, w))
        ids, places, slots, mask, cos, sin = bucket.region
        ids.copy_(step_ids(pool, rows))
        places.copy_(step_places(pool, rows))
        slots.copy_(bucket.source[1])
        mask.copy_(bucket.source[2])
        if cos is not None:
            cos.copy_(dense.cos)
            sin.copy_(dense.sin)

    # -- running ------------------------------------------------------------------------------------
    def _run(self, bucket: StaticBucket) -> torch.Tensor:
        """The model's forward over ``bucket``'s buffers alone: logits [1, B, V]."""
        runner = self.runner
        if self._compiled is not None:
            graph = (min(bucket.key[0], 2), bucket.key[2])
            first = graph not in self.compile_seconds
            t0 = time.perf_counter()
            logits = self._compiled(*bucket.inputs)
            if first:
                self.compile_seconds[graph] = time.perf_counter() - t0
                log.info("compiled the static decode step (rows %s, rotation %s) in %.1f s", *graph,
                         self.compile_seconds[graph])
            return logits
        kwargs = {"position_ids": bucket.pos} if runner.adapter.passes_position_ids else {}
        out = runner.model(input_ids=bucket.ids, past_key_values=PagedCache(bucket.plan.pool, bucket.write),
                           use_cache=True, logits_to_keep=0, pc_plan=bucket.plan, **kwargs)
        return out.logits

    def _replay(self, bucket: StaticBucket) -> torch.Tensor:
        runner = self.runner
        swapped = attention_swapped(runner, STATIC_ATTENTION) if self._compiled is not None \
            else attention_swapped(runner, pc_plan=bucket.plan)
        with torch.inference_mode(), runner.lock, swapped, torch.profiler.record_function(STATIC_RANGE):
            if not self.capture:  # the CPU: the same step, uncaptured
                bucket.logits = self._run(bucket)
                return bucket.logits
            if bucket.graph is None:
                try:
                    self._capture(bucket)
                except RuntimeError as e:  # an op the capture refuses: correct steps, uncaptured
                    self.capture, self.capture_error = False, f"{type(e).__name__}: {e}"
                    log.warning("capturing the decode step of bucket %s failed (%s): static steps run uncaptured "
                                "from now on", bucket.key, self.capture_error)
                    bucket.dense.work.clear()
                    bucket.logits = self._run(bucket)
                    return bucket.logits
            bucket.graph.replay()
            self.replayed += 1
            return bucket.logits

    def _capture(self, bucket: StaticBucket) -> None:
        """Record ``bucket``'s step as a CUDA graph: one eager run first (lazy allocations, kernel
        choices), then the capture into the shared memory pool (the buffers a layer gathers into
        are made again inside it). Only the graph's output (the logits) stays held between replays:
        it is read (cloned) before the next replay, of whatever bucket, may overwrite it."""
        t0 = time.perf_counter()
        dev = self.runner.device
        torch.cuda.synchronize(dev)
        self._run(bucket)
        torch.cuda.synchronize(dev)
        bucket.dense.work.clear()
        if self._mempool is None:
            self._mempool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._mempool):
            bucket.logits = self._run(bucket)
        bucket.graph = graph
        # the gather buffers go back to the shared pool (the graph keeps their addresses): every replay
        # writes them before reading them, so later captures may reuse them as the intermediates are;
        # the buckets' graphs then hold about the largest one's memory, not the sum
        bucket.dense.work.clear()
        torch.cuda.synchronize(dev)
        self.capture_seconds[bucket.key] = time.perf_counter() - t0
        log.info("captured the decode step of bucket %s (rows, keys a row, rotation) in %.2f s", bucket.key,
                 self.capture_seconds[bucket.key])
