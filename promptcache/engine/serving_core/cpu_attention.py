"""The native CPU attention kernel (``native/attention.cpp``), built once per machine and loaded as
``torch.ops.promptcache_native`` (``attend``: queries over keys, causal chunks too;
``attend_gather``: decode rows over their own keys read from the pool by slot); ``kernel_for`` and
``gather_kernel_for`` hand them to ``engine/serving_core/paged.py``.

Why: torch's fused CPU attention (``_scaled_dot_product_flash_attention_for_cpu``) does its matrix
products through MKL's sgemm, which on an AMD CPU takes its AVX2 path: on the 2-core AMD EPYC
where promptcache is measured, the fused attention ran at a third of the rate oneDNN's packed
linears reach. The kernel here (one pass of online softmax over tiles that stay in L1,
register-blocked vector loops, torch's own OpenMP threads) is faster than torch's on every shape
the paged engine runs (``python -m eval.bench_attention``; figures: eval/results/attention.md).

It is compiled at first use with torch's C++ extension loader (the system's C++ compiler and
``ninja``; ``-march=native``, so the build is keyed by this machine's CPU flags) into torch's
extension folder (``TORCH_EXTENSIONS_DIR``, default ``~/.cache/torch_extensions``): ~10 s once,
then a load of a few milliseconds. Where it cannot be built (no compiler) a warning says why and
torch's fused kernel is used; both compute the same attention (float32, within rounding: the
tests hold them to 1e-5). ``PROMPTCACHE_NATIVE_ATTENTION=0`` turns the kernel off.

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

import hashlib
import logging
import os
import platform
import threading
import time
from pathlib import Path

import torch

log = logging.getLogger(__name__)

__all__ = ["ENV_SWITCH", "available", "gather_kernel_for", "kernel_for", "unavailable_reason"]

ENV_SWITCH = "PROMPTCACHE_NATIVE_ATTENTION"
_SOURCE = Path(__file__).with_name("native") / "attention.cpp"
_CFLAGS = ["-O3", "-march=native", "-fopenmp"]  # -fopenmp: ATen's parallel_for is inline OpenMP;
# the extension then binds to the libgomp torch has already loaded (one thread pool)

_lock = threading.Lock()
_state: dict[str, object] = {}  # "ops": the loaded ops, or "reason": why there are none


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor()


def _build():
    """Compile (or find compiled) and load the extension; returns its ops (torch.ops.promptcache_native)."""
    from torch.utils import cpp_extension  # heavy: only when the kernel is wanted

    source = _SOURCE.read_bytes()
    digest = hashlib.sha256(source + " ".join(_CFLAGS).encode() + _cpu_flags().encode()
                            + torch.__version__.encode()).hexdigest()[:12]
    t0 = time.perf_counter()
    log.info("loading the native CPU attention kernel (compiled on first use on this machine: ~10 s)")
    cpp_extension.load(name=f"promptcache_attention_{digest}", sources=[str(_SOURCE)], extra_cflags=_CFLAGS,
                       extra_ldflags=["-fopenmp"], is_python_module=False, verbose=False)
    ops = torch.ops.promptcache_native

    @torch.library.register_fake("promptcache_native::attend")
    def _(q, k, v, scale, causal_t):  # shapes for torch.compile's tracing
        return q.new_empty(q.shape), q.new_empty(q.shape[:2])

    @torch.library.register_fake("promptcache_native::attend_gather")
    def _(q, k, v, slots, lengths, scale):
        return q.new_empty(q.shape), q.new_empty(q.shape[:3])

    log.info("native CPU attention kernel ready in %.1f s (%s)", time.perf_counter() - t0, _SOURCE.name)
    return ops


def available() -> bool:
    """Whether the native kernel can be used (builds or loads it on the first call)."""
    if "ops" in _state or "reason" in _state:
        return "ops" in _state
    with _lock:
        if "ops" in _state or "reason" in _state:
            return "ops" in _state
        if os.environ.get(ENV_SWITCH, "1").strip().lower() in ("0", "false", "no", "off"):
            _state["reason"] = f"turned off by {ENV_SWITCH}"
            log.info("native CPU attention kernel %s; using torch's fused kernel", _state["reason"])
            return False
        try:
            _state["ops"] = _build()
        except Exception as exc:  # no compiler, no ninja, a failed build: torch's kernel computes the same
            _state["reason"] = f"{type(exc).__name__}: {str(exc).strip().splitlines()[-1] if str(exc).strip() else ''}"
            log.warning("native CPU attention kernel unavailable (%s); using torch's fused kernel, slower "
                        "attention on CPU (set %s=0 to silence this)", _state["reason"], ENV_SWITCH)
    return "ops" in _state


def unavailable_reason() -> str | None:
    """Why the kernel is not used (None: it is, or it was not asked for yet)."""
    return _state.get("reason")  # type: ignore[return-value]


def _covers(q: torch.Tensor, dtypes: tuple[torch.dtype, ...] = (torch.float32,)) -> bool:
    d = q.shape[-1]
    return q.device.type == "cpu" and q.dtype in dtypes and d % 16 == 0 and 16 <= d <= 256 and available()


KV_DTYPES = (torch.float32, torch.bfloat16)  # what the kernel reads keys and values in


def kernel_for(q: torch.Tensor, kv: torch.Tensor | None = None):
    """The native op for queries ``q`` [X, M, D] when it covers them (CPU, float32 or bfloat16, D a
    multiple of 16 up to 256; keys/values ``kv`` float32 or bfloat16 where given), else None.
    Called as ``op(q, k, v, scale, causal_t) -> (out, lse)`` (float32). bfloat16 queries over
    bfloat16 keys/values take bfloat16 products with float32 sums where the CPU has AVX-512 BF16."""
    return _state["ops"].attend if (kv is None or kv.dtype in KV_DTYPES) and _covers(q, KV_DTYPES) else None


def gathers(buf: torch.Tensor) -> bool:
    """Whether decode rows over the pool buffer ``buf`` [L, 2, Hk, S, D] are read by the native
    gather op (``gather_kernel_for``): it reads each row's own slots in place, up to the row's own
    length, so a row's own length costs no padding or copy and every decode row can go through it."""
    d = buf.shape[-1]
    return buf.device.type == "cpu" and buf.dtype in KV_DTYPES and d % 16 == 0 and 16 <= d <= 256 and available()


def gather_kernel_for(q: torch.Tensor, kv: torch.Tensor):
    """The native gather op for decode queries ``q`` [X, B, G, D] over a pool buffer ``kv`` when
    it covers them (as ``kernel_for``, and a float32 or bfloat16 pool), else None. Called as
    ``op(q, k, v, slots, lengths, scale) -> (out [X, B, G, D], lse [X, B, G])``."""
    return _state["ops"].attend_gather if kv.dtype in KV_DTYPES and _covers(q) else None
