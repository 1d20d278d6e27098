"""RMSNorm layers computed in one native pass on the CPU: ``fuse_rms_norms(model) -> int``.

transformers' Llama-family RMSNorm (Llama, Mistral, Qwen2, Qwen3, Phi-3, SmolLM2, ...) is eight
elementwise ops a call (widen, square, mean, add, rsqrt, multiply, narrow, multiply), each a pass
over the activations; in bfloat16 each pays its own conversions, and the norms (two a layer and
a final one) were ~7% of a bfloat16 prefill on the 2-core machine promptcache is measured on. The
native kernel (``kernels/rms_norm.cpp``, compiled at first use: ``kernels/build.py``)
computes the same thing in one pass: float32 inside, and in bfloat16 the stock forward's two
roundings (the normalized row, then its product with the weight), so a bfloat16 model's norms
agree with the stock ones to the last bit except where float32 sums in another order round
differently; float32 agrees to rounding.

Only a layer whose class's ``forward`` is, text for text, the Llama form below is swapped (a
family that adds one to the weight, norms in float32 to the end, or centres the row keeps its
own): the swap is an instance ``forward`` (as ``models/packed.py`` does for linears), the module
and its weight stay, and a call the kernel does not cover (another device or dtype) runs the stock
forward. ``RunnerConfig.packed_linear`` (the CPU fast path) fuses the norms with the linears;
``PROMPTCACHE_NATIVE_NORM=0`` turns the kernel off.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from .build import NativeKernels
from .forms import has_form

log = logging.getLogger(__name__)

__all__ = ["ENV_SWITCH", "KERNELS", "FusedRMSNorm", "fuse_rms_norms"]

ENV_SWITCH = "PROMPTCACHE_NATIVE_NORM"

# the Llama family's RMSNorm.forward, as transformers writes it (and copies into other families)
LLAMA_FORWARD = '''
def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
    input_dtype = hidden_states.dtype
    hidden_states = hidden_states.to(torch.float32)
    variance = hidden_states.pow(2).mean(-1, keepdim=True)
    hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
    return self.weight * hidden_states.to(input_dtype)
'''


def _register_fake(ops) -> None:
    @torch.library.register_fake("promptcache_norm::rms_norm")
    def _(x, weight, eps):  # shapes for torch.compile's tracing
        return torch.empty_like(x)


# the kernel (public for its tests: ``KERNELS.ops.rms_norm``, ``KERNELS.unavailable_reason()``)
KERNELS = NativeKernels(Path(__file__).with_name("rms_norm.cpp"), "promptcache_norm", "native RMSNorm kernel",
                        ENV_SWITCH, _register_fake)

class FusedRMSNorm:
    """The ``forward`` of one Llama-form RMSNorm: the native kernel where it covers the call (CPU,
    float32 or bfloat16 like the weight), else the module's own forward."""

    def __init__(self, module: torch.nn.Module):
        self.module = module
        self.stock = type(module).forward.__get__(module)

    def __call__(self, hidden_states: torch.Tensor) -> torch.Tensor:
        w = self.module.weight
        if hidden_states.device.type != "cpu" or hidden_states.dtype != w.dtype \
                or w.dtype not in (torch.float32, torch.bfloat16) or torch.is_grad_enabled() and w.requires_grad:
            return self.stock(hidden_states)
        return KERNELS.ops.rms_norm(hidden_states, w, float(self.module.variance_epsilon))


def fuse_rms_norms(model: torch.nn.Module) -> int:
    """Give every Llama-form RMSNorm of ``model`` (CPU weights) the native kernel's forward, in
    place; returns how many (0 where the kernel is off or cannot be built: logged)."""
    norms = [m for m in model.modules()
             if has_form(type(m), LLAMA_FORWARD) and isinstance(getattr(m, "weight", None), torch.Tensor)
             and m.weight.dim() == 1 and m.weight.device.type == "cpu" and hasattr(m, "variance_epsilon")
             and not isinstance(m.__dict__.get("forward"), FusedRMSNorm)]
    if not norms or not KERNELS.available():
        return 0
    for m in norms:
        m.forward = FusedRMSNorm(m)
    log.info("RMSNorm: %d layers run the native kernel", len(norms))
    return len(norms)
