"""The native CPU attention kernel (``kernels/attention.cpp``), built once per environment and loaded as
``torch.ops.promptcache_native`` (``attend``: queries over keys, causal chunks too;
``attend_gather``: decode rows over their own keys read from the pool by slot; ``attend_gather_runs``:
the same with runs of a row's keys read with its queries rotated, for documents read in place at
another position; ``attend_prefill_runs``: prefill rows over such runs, each query seeing a prefix
of each run); ``kernel_for``, ``gather_kernel_for``, ``gather_runs_kernel_for`` and
``prefill_runs_kernel_for`` hand them to ``engine/serving_core/paged.py``.

Why: torch's fused CPU attention (``_scaled_dot_product_flash_attention_for_cpu``) does its matrix
products through MKL's sgemm, which on an AMD CPU takes its AVX2 path: on the 2-core AMD EPYC
where promptcache is measured, the fused attention ran at a third of the rate oneDNN's packed
linears reach. The kernel here (one pass of online softmax over tiles that stay in L1,
register-blocked vector loops, torch's own OpenMP threads) is faster than torch's on every shape
the paged engine runs (``python -m eval.bench_attention``; figures: eval/results/attention.md).

It is compiled at first use in each Python environment (``kernels/build.py``: once, up to a few
minutes on a busy 2-core machine, the log line says how long; then a load of a few milliseconds; a
build running in another process is never waited on past ``PROMPTCACHE_KERNEL_WAIT``). Where it cannot be built (no compiler) a warning says why and torch's fused
kernel is used; both compute the same attention (float32, within rounding: the tests hold them
to 1e-5). ``PROMPTCACHE_NATIVE_ATTENTION=0`` turns the kernel off.

It covers what the engine's CPU attention calls without a mask: float32 queries over float32 or
bfloat16 keys and values (a bfloat16 pool is read in place, each element widened to float32 as it
is read: float32 products and sums, half the bytes, no converted copy), head dims that are a
multiple of 16 up to 256, keys read in place through strides, and causal chunks. A bfloat16
model's queries over its bfloat16 pool go in as they are: where the CPU has AVX-512 BF16 the
products are bfloat16 pairs summed in float32 (``vdpbf16ps``, twice the float32 rate; the scores
are the same float32 sums of exact products, the probabilities rounded to bfloat16 before P V as
torch's bfloat16 attention rounds them); elsewhere they are widened (exact) and run as float32.
Anything else (a mask tensor, a float16 pool, another head dim, CUDA) stays on torch's kernels.
"""

from __future__ import annotations

from pathlib import Path

import torch

from .build import NativeKernels

__all__ = ["ENV_SWITCH", "available", "gather_kernel_for", "gather_runs_kernel_for", "kernel_for", "limits_kernel_for",
           "prefill_runs_kernel_for", "unavailable_reason"]

ENV_SWITCH = "PROMPTCACHE_NATIVE_ATTENTION"


def _register_fakes(ops) -> None:
    @torch.library.register_fake("promptcache_native::attend")
    def _(q, k, v, scale, causal_t):  # shapes for torch.compile's tracing
        return q.new_empty(q.shape, dtype=torch.float32), q.new_empty(q.shape[:2], dtype=torch.float32)

    @torch.library.register_fake("promptcache_native::attend_gather")
    def _(q, k, v, slots, lengths, scale):
        return q.new_empty(q.shape, dtype=torch.float32), q.new_empty(q.shape[:3], dtype=torch.float32)

    @torch.library.register_fake("promptcache_native::attend_gather_runs")
    def _(q, k, v, slots, lengths, scale, run_starts, run_src, run_rot, cos, sin, sources, layer):
        return q.new_empty(q.shape, dtype=torch.float32), q.new_empty(q.shape[:3], dtype=torch.float32)

    @torch.library.register_fake("promptcache_native::attend_prefill_runs")
    def _(q, k, v, slots, lengths, scale, run_starts, run_src, run_rot, cos, sin, sources, layer, query_row, limits):
        return q.new_empty(q.shape, dtype=torch.float32), q.new_empty(q.shape[:3], dtype=torch.float32)

    @torch.library.register_fake("promptcache_native::attend_limits")
    def _(q, k, v, scale, limits):
        return q.new_empty(q.shape, dtype=torch.float32), q.new_empty(q.shape[:2], dtype=torch.float32)


_KERNELS = NativeKernels(Path(__file__).with_name("attention.cpp"), "promptcache_native",
                                 "native CPU attention kernel", ENV_SWITCH, _register_fakes)


def available() -> bool:
    """Whether the native kernel can be used (builds or loads it on the first call)."""
    return _KERNELS.available()


def unavailable_reason() -> str | None:
    """Why the kernel is not used (None: it is, or it was not asked for yet)."""
    return _KERNELS.unavailable_reason()


def _covers(q: torch.Tensor, dtypes: tuple[torch.dtype, ...] = (torch.float32,)) -> bool:
    d = q.shape[-1]
    return q.device.type == "cpu" and q.dtype in dtypes and d % 16 == 0 and 16 <= d <= 256 and available()


KV_DTYPES = (torch.float32, torch.bfloat16)  # what the kernel reads keys and values in


def kernel_for(q: torch.Tensor, kv: torch.Tensor | None = None):
    """The native op for queries ``q`` [X, M, D] when it covers them (CPU, float32 or bfloat16, D a
    multiple of 16 up to 256; keys/values ``kv`` float32 or bfloat16 where given), else None.
    Called as ``op(q, k, v, scale, causal_t) -> (out, lse)`` (float32). bfloat16 queries over
    bfloat16 keys/values take bfloat16 products with float32 sums where the CPU has AVX-512 BF16."""
    return _KERNELS.ops.attend if (kv is None or kv.dtype in KV_DTYPES) and _covers(q, KV_DTYPES) else None


def limits_kernel_for(q: torch.Tensor, kv: torch.Tensor):
    """The native op for queries ``q`` [X, M, D] that each see a prefix of the keys ``kv`` [X, N, D],
    when it covers them (as ``kernel_for``), else None. Called as ``op(q, k, v, scale, limits) ->
    (out, lse)`` (float32): row r of every head sees keys 0 .. limits[r] - 1 (int64 [M], 1 .. N)."""
    return _KERNELS.ops.attend_limits if kv.dtype in KV_DTYPES and _covers(q, KV_DTYPES) else None


def gathers(buf: torch.Tensor) -> bool:
    """Whether decode rows over the pool buffer ``buf`` [L, 2, Hk, S, D] are read by the native
    gather op (``gather_kernel_for``): it reads each row's own slots in place, up to the row's own
    length, so a row's own length costs no padding or copy and every decode row can go through it."""
    d = buf.shape[-1]
    return buf.device.type == "cpu" and buf.dtype in KV_DTYPES and d % 16 == 0 and 16 <= d <= 256 and available()


def gather_kernel_for(q: torch.Tensor, kv: torch.Tensor):
    """The native gather op for decode queries ``q`` [X, B, G, D] over a pool buffer ``kv`` when
    it covers them (as ``kernel_for``, and a float32 or bfloat16 pool), else None. Called as
    ``op(q, k, v, slots, lengths, scale) -> (out [X, B, G, D], lse [X, B, G])`` (float32); bfloat16
    queries over a bfloat16 pool read the keys rows share in bfloat16 products where the CPU has
    AVX-512 BF16."""
    return _KERNELS.ops.attend_gather if kv.dtype in KV_DTYPES and _covers(q, KV_DTYPES) else None


def gather_runs_kernel_for(q: torch.Tensor, kv: torch.Tensor):
    """The native gather op over runs for decode queries ``q`` [X, B, G, D] over a pool buffer
    ``kv``, when it covers them (as ``gather_kernel_for``), else None. Called as
    ``op(q, k, v, slots, lengths, scale, run_starts, run_src, run_rot, cos, sin, sources, layer) ->
    (out, lse)``: row b's slots ``[run_starts[b, i], run_starts[b, i + 1])`` (int64 [B, R], the last
    run up to ``lengths[b]``, ``run_starts[b, 0] = 0``) are tokens of ``k``/``v`` (``run_src[b, i]
    = -1``) or of ``sources[s]`` (a store's states [L, 2, X, n, D] in the pool's dtype, read in place
    at layer ``layer``), read with the row's queries rotated by row ``run_rot[b, i]`` of ``cos``,
    ``sin`` (float32 [S, r], as ``dense.rotation`` builds them: the rotate-half form over the first
    r channels; -1: the queries as they are). Each rotation is done once per run and query, in
    float32. Runs several rows read alike (a document at any position and shift) are read
    together, every row's rotated queries over packed key tiles (bfloat16 queries rounded back to
    bfloat16 there, as torch's ``.to(torch.bfloat16)``, for bfloat16 products); the rest of each
    row with its queries in float32."""
    return _KERNELS.ops.attend_gather_runs if kv.dtype in KV_DTYPES and _covers(q, KV_DTYPES) else None


def prefill_runs_kernel_for(q: torch.Tensor, kv: torch.Tensor):
    """The native op for a step's prefill queries ``q`` [X, G, M, D] over runs of their rows' keys
    (as ``gather_runs_kernel_for``'s) when it covers them, else None. Called as
    ``op(q, k, v, slots, lengths, scale, run_starts, run_src, run_rot, cos, sin, sources, layer,
    query_row, limits) -> (out [X, G, M, D], lse [X, G, M])`` (float32): query i belongs to row
    ``query_row[i]`` (int64 [M]) and sees the first ``limits[i, j]`` keys of that row's run j (int64
    [M, R], 0 .. the run's keys: a document's prefix in selective recompute's prompt order, causal
    over the row's own tokens), each run read with the query rotated by the run's rotation, one
    online softmax over all of them. A row's key tiles are packed once (on first use) for all its
    query tiles (consecutive queries, all their query heads); key tiles past a query tile's longest
    limit are not read.
    bfloat16 queries over a bfloat16 pool take bfloat16 products (float32 sums, the rotated queries
    and the probabilities rounded to bfloat16) where the CPU has AVX-512 BF16, as the decode rows'
    group pass and the causal call do; other bfloat16 queries are widened (exact): float32 products
    and sums."""
    return _KERNELS.ops.attend_prefill_runs if kv.dtype in KV_DTYPES and _covers(q, KV_DTYPES) else None
