"""promptcache's native CPU kernels and the layers that use them.

``build``: ``NativeKernels``, a C++ source compiled at first use on this machine and loaded as
``torch.ops``; ``attention.cpp``: the paged engine's CPU attention (loaded by
``attention.py``); ``vectors.h``: the vector helpers the kernels share;
``rms_norm``: one-pass RMSNorm for Llama-form layers (``fuse_rms_norms``); ``fused``: a SiLU MLP's
activation and product, and the rotary embedding of queries and keys, one pass each for Llama-form
layers (``fuse_mlps_and_rotary``); ``forms``: the check that a layer class computes the form a kernel
replaces (its ``forward``'s text); ``ordered_attention``: masked forwards whose mask is causal in
some order of the keys (selective recompute's) on ``attention.cpp``'s per-query key prefixes.
"""

from .build import NativeKernels
from .fused import FusedAttention, FusedMLP, fuse_mlps_and_rotary
from .rms_norm import FusedRMSNorm, fuse_rms_norms

__all__ = ["FusedAttention", "FusedMLP", "FusedRMSNorm", "NativeKernels", "fuse_mlps_and_rotary", "fuse_rms_norms"]
