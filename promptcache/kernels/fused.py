"""Gated MLPs and rotary embeddings of Llama-form layers in one native pass each on the CPU:
``fuse_mlps_and_rotary(model) -> int``.

transformers' Llama-family MLP computes ``down(silu(gate(x)) * up(x))``: the activation and the
product are two passes over a [tokens, intermediate] tensor (the largest activations of a step);
its attention applies rotary embeddings as ``x * cos + rotate_half(x) * sin`` to the queries and
the keys, five ops and a concatenation each. With packed linears both were ~11% of a SmolLM2 RAG
batch's CPU time on the 2-core machine promptcache is measured on, more in bfloat16 (where the
linears run twice as fast and each op pays its own conversions). ``kernels/fused.cpp`` (compiled
at first use: ``kernels/build.py``) does each in one pass, rounding as the stock ops round
(float32: to a few ulps of torch's exp; bfloat16: each stock op's result rounded where the stock
op rounds it).

As with ``rms_norm.fuse_rms_norms``, only a module whose class's ``forward`` is, text for text,
the Llama form below is given the fused forward (an instance ``forward``; the module, its weights
and its linears' own forwards, packed or not, stay): an MLP whose activation is SiLU, an
attention whose rotary embedding covers the whole head. A call the kernels do not cover (another
device or dtype, a partial rotary) runs the stock forward. ``RunnerConfig.packed_linear`` (the
CPU fast path) fuses them with the norms; ``PROMPTCACHE_NATIVE_FUSED=0`` turns the kernels off.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import torch
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from .build import NativeKernels
from .forms import has_form

log = logging.getLogger(__name__)

__all__ = ["ENV_SWITCH", "KERNELS", "FusedAttention", "FusedMLP", "fuse_mlps_and_rotary"]

ENV_SWITCH = "PROMPTCACHE_NATIVE_FUSED"

# the Llama family's MLP.forward and Attention.forward, as transformers writes them (and copies
# into other families); the fused forwards below are these with the two passes replaced
LLAMA_MLP_FORWARD = '''
def forward(self, x):
    down_proj = self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))
    return down_proj
'''

LLAMA_ATTENTION_FORWARD = '''
def forward(
    self,
    hidden_states: torch.Tensor,
    position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
    attention_mask: torch.Tensor | None = None,
    past_key_values: Cache | None = None,
    **kwargs: Unpack[TransformersKwargs],
) -> tuple[torch.Tensor, torch.Tensor]:
    input_shape = hidden_states.shape[:-1]
    hidden_shape = (*input_shape, -1, self.head_dim)

    query_states = self.q_proj(hidden_states).view(hidden_shape).transpose(1, 2)
    key_states = self.k_proj(hidden_states).view(hidden_shape).transpose(1, 2)
    value_states = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)

    cos, sin = position_embeddings
    query_states, key_states = apply_rotary_pos_emb(query_states, key_states, cos, sin)

    if past_key_values is not None:
        key_states, value_states = past_key_values.update(key_states, value_states, self.layer_idx)

    attention_interface: Callable = ALL_ATTENTION_FUNCTIONS.get_interface(
        self.config._attn_implementation, eager_attention_forward
    )

    attn_output, attn_weights = attention_interface(
        self,
        query_states,
        key_states,
        value_states,
        attention_mask,
        dropout=0.0 if not self.training else self.attention_dropout,
        scaling=self.scaling,
        **kwargs,
    )

    attn_output = attn_output.reshape(*input_shape, -1).contiguous()
    attn_output = self.o_proj(attn_output)
    return attn_output, attn_weights
'''


def _register_fake(ops) -> None:  # shapes for torch.compile's tracing
    @torch.library.register_fake("promptcache_fused::silu_mul")
    def _(gate, up):
        return gate.new_empty(gate.shape)

    @torch.library.register_fake("promptcache_fused::rotary")
    def _(q, k, cos, sin):
        def out(x):
            b, h, n, d = x.shape
            return x.new_empty((b, n, h, d)).transpose(1, 2)

        return out(q), out(k)


# the kernels (public for their tests: ``KERNELS.ops.silu_mul``, ``KERNELS.ops.rotary``)
KERNELS = NativeKernels(Path(__file__).with_name("fused.cpp"), "promptcache_fused", "native fused MLP/rotary kernels",
                        ENV_SWITCH, _register_fake)

def _covered(x: torch.Tensor) -> bool:
    return x.device.type == "cpu" and x.dtype in (torch.float32, torch.bfloat16) \
        and not (torch.is_grad_enabled() and x.requires_grad)


def _silu(act) -> bool:
    """Whether an MLP's ``act_fn`` is SiLU (torch's module or transformers' own)."""
    return isinstance(act, torch.nn.SiLU) or type(act).__name__ == "SiLUActivation" \
        and type(act).__module__ == "transformers.activations"


class FusedMLP:
    """The ``forward`` of one Llama-form SiLU MLP: ``down(silu_mul(gate(x), up(x)))``."""

    def __init__(self, module: torch.nn.Module):
        self.module = module
        self.stock = type(module).forward.__get__(module)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if not _covered(x):
            return self.stock(x)
        m = self.module
        return m.down_proj(KERNELS.ops.silu_mul(m.gate_proj(x), m.up_proj(x)))


class FusedAttention:
    """The ``forward`` of one Llama-form attention, its rotary embedding in one native pass."""

    def __init__(self, module: torch.nn.Module):
        self.module = module
        self.stock = type(module).forward.__get__(module)
        self.eager = sys.modules[type(module).__module__].eager_attention_forward  # the stock default

    def __call__(self, hidden_states: torch.Tensor, position_embeddings=None, attention_mask=None,
                 past_key_values=None, **kwargs):
        m = self.module
        cos, sin = position_embeddings if position_embeddings is not None else (None, None)
        if cos is None or not _covered(hidden_states) or cos.dim() != 3 or cos.shape[-1] != m.head_dim \
                or cos.dtype != hidden_states.dtype or sin.dtype != cos.dtype:
            return self.stock(hidden_states, position_embeddings, attention_mask, past_key_values, **kwargs)
        input_shape = hidden_states.shape[:-1]
        hidden_shape = (*input_shape, -1, m.head_dim)
        query = m.q_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        key = m.k_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        value = m.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        query, key = KERNELS.ops.rotary(query, key, cos, sin)
        if past_key_values is not None:
            key, value = past_key_values.update(key, value, m.layer_idx)
        attention = ALL_ATTENTION_FUNCTIONS.get_interface(getattr(m.config, "_attn_implementation", None) or "eager",
                                                          self.eager)
        out, weights = attention(m, query, key, value, attention_mask,
                                 dropout=0.0 if not m.training else m.attention_dropout, scaling=m.scaling, **kwargs)
        return m.o_proj(out.reshape(*input_shape, -1).contiguous()), weights


def fuse_mlps_and_rotary(model: torch.nn.Module) -> int:
    """Give every Llama-form SiLU MLP and Llama-form attention of ``model`` (CPU weights) the
    fused forward, in place; returns how many modules (0 where the kernels are off or cannot be
    built: logged)."""
    mlps, attentions = [], []
    for m in model.modules():
        if isinstance(m.__dict__.get("forward"), (FusedMLP, FusedAttention)):
            continue
        weight = next(m.parameters(recurse=True), None)
        if weight is None or weight.device.type != "cpu":
            continue
        if has_form(type(m), LLAMA_MLP_FORWARD) and _silu(getattr(m, "act_fn", None)):
            mlps.append(m)
        elif has_form(type(m), LLAMA_ATTENTION_FORWARD) and hasattr(m, "head_dim") \
                and hasattr(sys.modules[type(m).__module__], "eager_attention_forward"):
            attentions.append(m)
    if not (mlps or attentions) or not KERNELS.available():
        return 0
    for m in mlps:
        m.forward = FusedMLP(m)
    for m in attentions:
        m.forward = FusedAttention(m)
    log.info("fused kernels: %d MLPs (SiLU and product), %d attentions (rotary)", len(mlps), len(attentions))
    return len(mlps) + len(attentions)
