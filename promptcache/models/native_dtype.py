"""Which 16-bit dtypes this machine computes natively, and the dtype ``auto`` stands for.

A CPU with bfloat16 instructions (AVX-512 BF16 on AMD Zen 4/5 and Intel Cooper Lake on, AMX on
Sapphire Rapids) runs oneDNN's bfloat16 matrix products at about twice the float32 rate (the
matrices are half the bytes, the dot products twice as wide); one without them emulates bfloat16
by converting to float32 and back, slower than float32 itself. So bfloat16 is used on a CPU only
where oneDNN says it has the instructions (``torch.ops.mkldnn._is_mkldnn_bf16_supported``).

``PROMPTCACHE_BF16=0`` forces the capability off (the tests use it to stand for a CPU without
bfloat16): ``auto`` then resolves to float32, and bfloat16 packed linears are refused.

``auto_dtype``: the dtype ``--dtype auto`` (``serve``'s and ``from_pretrained``'s default) loads a
checkpoint in: its own dtype (``config.dtype``, ``torch_dtype`` in older configs) where the device
computes it natively, float32 otherwise. On CUDA a float32 checkpoint loads in bfloat16 (as
before: a GPU's fast dtype); on a CPU a float32 checkpoint stays float32 (a cast down would
change the model's numbers, which ``auto`` never does on a CPU).
"""

from __future__ import annotations

import functools
import logging
import os

import torch

log = logging.getLogger(__name__)

__all__ = ["ENV_SWITCH", "auto_dtype", "bf16_native", "bf16_refusal", "checkpoint_dtype"]

ENV_SWITCH = "PROMPTCACHE_BF16"
_OFF = ("0", "false", "no", "off")


@functools.cache
def _cpu_bf16() -> str | None:
    """Why this CPU cannot compute bfloat16 natively (None: it can). Asked once per process."""
    if not torch.backends.mkldnn.is_available():
        return "this torch build has no oneDNN (mkldnn)"
    probe = getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", None)
    if probe is None:
        return "this torch build cannot say whether the CPU has bfloat16 instructions"
    if not probe():
        return "this CPU has no bfloat16 instructions (avx512_bf16 / amx_bf16)"
    return None


def bf16_refusal(device: str | torch.device = "cpu") -> str | None:
    """Why ``device`` does not compute bfloat16 natively (None: it does). ``PROMPTCACHE_BF16=0``
    makes every CPU answer no."""
    dev = torch.device(device)
    if dev.type == "cuda":
        return None if torch.cuda.is_available() and torch.cuda.is_bf16_supported() else "this GPU has no bfloat16"
    if dev.type != "cpu":
        return f"bfloat16 support on {dev.type} is not checked; pass --dtype explicitly"
    if os.environ.get(ENV_SWITCH, "1").strip().lower() in _OFF:
        return f"turned off by {ENV_SWITCH}"
    return _cpu_bf16()


def bf16_native(device: str | torch.device = "cpu") -> bool:
    return bf16_refusal(device) is None


def checkpoint_dtype(config) -> torch.dtype:
    """The dtype a checkpoint's config says its weights are in (float32 when it says none)."""
    found = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    if isinstance(found, str):
        found = getattr(torch, found, None)
    return found if isinstance(found, torch.dtype) and found.is_floating_point else torch.float32


def auto_dtype(config, device: str | torch.device = "cpu") -> tuple[torch.dtype, str]:
    """(the dtype ``auto`` loads ``config``'s checkpoint in on ``device``, why: one line to log)."""
    dev = torch.device(device)
    want = checkpoint_dtype(config)
    name = str(want).removeprefix("torch.")
    if dev.type == "cuda":
        if want in (torch.bfloat16, torch.float16):
            return want, f"the checkpoint's {name}"
        return torch.bfloat16, f"bfloat16 on CUDA (the checkpoint is {name})"
    if want == torch.float32:
        return want, "the checkpoint's float32"
    if want == torch.bfloat16:
        why = bf16_refusal(dev)
        if why is None:
            return want, f"the checkpoint's bfloat16: this {dev.type.upper()} computes it natively"
        return torch.float32, f"float32: the checkpoint is bfloat16 but {why}"
    return torch.float32, f"float32: the checkpoint is {name}, which a {dev.type.upper()} does not compute natively here"
