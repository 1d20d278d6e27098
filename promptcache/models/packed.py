"""Linear layers through oneDNN with their weights packed once (CPU, float32): ``pack_linears``.

transformers runs every ``nn.Linear`` through ``F.linear`` (MKL on x86), which re-reads the
weight in its plain layout at every call. oneDNN's linear with the weight reordered once into its
blocked layout (torch's oneDNN ops ``mkldnn::_reorder_linear_weight`` / ``_linear_pointwise``, the same
primitive vLLM's CPU build and inductor's weight freezing use) is markedly faster here: on
SmolLM2-135M, 2 threads, a decode step went 39.2 -> 19.6 ms and a 1K prefill 1.81 -> 1.08 s, the
last-token logits within 7.8e-5 of the stock forward (float32 rounding order; eval/README.md).

The model object is changed in place: each ``nn.Linear`` gets a ``forward`` that calls the packed
weight (its parameters stay, so a tied embedding and everything that reads weights still work;
the packed copies cost one more copy of the linear weights in memory). It is an opt-in
(``RunnerConfig.packed_linear``, ``--packed-linear``): every forward of that model, inside
promptcache or not, then computes with the packed weights, equal to the stock forward within
float32 rounding, not bit for bit. A self-check on the first layer refuses to pack when the two
disagree beyond that.
"""

from __future__ import annotations

import logging

import torch

from ..errors import ConfigError

log = logging.getLogger(__name__)

__all__ = ["PackedLinear", "pack_linears", "packed_refusal"]

# torch's oneDNN linear ops (what inductor's weight freezing emits on CPU); underscored in torch, so
# looked up once here: a build without them makes ``packed_refusal`` say so, never a crash
_REORDER = getattr(torch.ops.mkldnn, "_reorder_linear_weight", None)
_LINEAR = getattr(torch.ops.mkldnn, "_linear_pointwise", None)


class PackedLinear:
    """The ``forward`` of one ``nn.Linear``: x [..., K] -> [..., N] through the packed weight."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        self.weight = _REORDER(weight.detach(), None)
        self.bias = None if bias is None else bias.detach()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():  # inductor cannot lower the oneDNN op: it stays one opaque call
            return torch.ops.promptcache.packed_linear(x, self.weight, self.bias)
        return _LINEAR(x, self.weight, self.bias, "none", [], "")


@torch.library.custom_op("promptcache::packed_linear", mutates_args=())
def _packed_linear_op(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The packed linear inside a compiled graph: x [..., K] -> [..., N]."""
    return _LINEAR(x, weight, bias, "none", [], "")


@_packed_linear_op.register_fake
def _(x, weight, bias):
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


def packed_refusal(model) -> str | None:
    """Why this model's linears cannot be packed (None: they can)."""
    p = next(model.parameters())
    if p.device.type != "cpu":
        return f"the model is on {p.device.type}; packed linears are a CPU path"
    if p.dtype != torch.float32:
        return f"the model computes in {str(p.dtype).removeprefix('torch.')}; packed linears are float32 only"
    if not torch.backends.mkldnn.is_available() or _REORDER is None or _LINEAR is None:
        return "this torch build has no oneDNN (mkldnn) linear"
    return None


def _self_check(linear: torch.nn.Linear) -> float:
    """Largest |difference| between the packed and the stock layer on a fixed probe, relative to
    the output's scale."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn((3, linear.in_features), generator=g)
    with torch.inference_mode():
        want = torch.nn.functional.linear(x, linear.weight, linear.bias)
        got = PackedLinear(linear.weight, linear.bias)(x)
    return ((got - want).abs().max() / want.abs().max().clamp_min(1e-30)).item()


def pack_linears(model) -> int:
    """Give every ``nn.Linear`` of ``model`` a packed forward; returns how many. Raises
    ConfigError naming ``packed_linear`` when the model cannot take it."""
    why = packed_refusal(model)
    if why is not None:
        raise ConfigError(f"RunnerConfig.packed_linear (--packed-linear): {why}")
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    if not linears:
        return 0
    err = _self_check(linears[0])
    if not err <= 1e-5:
        raise ConfigError(f"RunnerConfig.packed_linear (--packed-linear): the packed linear differs from F.linear by {err:.2g} "
                          "(relative) on this machine; leave it off")
    n = 0
    for m in linears:
        if not isinstance(m.__dict__.get("forward"), PackedLinear):
            m.forward = PackedLinear(m.weight, m.bias)
            n += 1
    log.info("packed %d linear layers for oneDNN", n)
    return n
