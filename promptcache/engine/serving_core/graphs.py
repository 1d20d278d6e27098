"""Compiled serving steps (``RunnerConfig.compile``, ``--compile``): ``CompiledSteps``.

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
  compiles a step function with a code object of its own (``_own_step``).
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
"""

from __future__ import annotations

import itertools
import logging
import os
import threading
import time
import types
from contextlib import contextmanager

import torch
from transformers import AttentionInterface

from ...errors import ConfigError
from ...tunables import COMPILE_BUCKETS
from .kvpool import KVPool
from .paged import PagedRow, StepPlan, attend, attention_swapped, build_plan, key_rule, paged_forward, \
    paged_refusal, query_rope, step_inputs

log = logging.getLogger(__name__)

__all__ = ["COMPILED_ATTENTION", "CompiledSteps", "bucket_for", "compile_options", "compile_refusal"]

COMPILED_ATTENTION = "promptcache_compiled"


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


def _own_step(model):
    """``model(**kwargs)`` as a function whose code object is this model's alone: dynamo caches
    compiled graphs on code objects and, not guarding the modules, would hand a graph traced for
    one model to another of the same class (seen: a bfloat16 model given a float32 one's graph)."""
    def step(**kwargs):
        return model(**kwargs)

    code = step.__code__.replace(co_name=f"compiled_step_{next(_steps_made)}")
    return types.FunctionType(code, step.__globals__, code.co_name, None, step.__closure__)


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
        keep = torch.tensor(ends + [last] * (rows_bucket - len(ends)), dtype=torch.long, device=dev)  # [R]
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
