"""Linear layers through oneDNN with their weights packed once (CPU; float32, and bfloat16 where
the CPU computes it natively): ``pack_linears``.

transformers runs every ``nn.Linear`` through ``F.linear`` (MKL on x86), which re-reads the
weight in its plain layout at every call. oneDNN's linear with the weight reordered once into its
blocked layout (torch's oneDNN ops ``mkldnn::_reorder_linear_weight`` / ``_linear_pointwise``, the same
primitive vLLM's CPU build and inductor's weight freezing use) is markedly faster here, with
last-token logits within float32 rounding of the stock forward (figures:
eval/results/design_figures.md).

The model object is changed in place: each ``nn.Linear`` gets a ``forward`` that calls the packed
weight (its parameters stay, so a tied embedding and everything that reads weights still work;
the packed copies cost one more copy of the linear weights in memory). It is an opt-in
(``RunnerConfig.packed_linear``, ``--packed-linear``): every forward of that model, inside
promptcache or not, then computes with the packed weights, equal to the stock forward within
float32 rounding, not bit for bit. A self-check on the first layer refuses to pack when the two
disagree beyond that.

A bfloat16 model is packed into oneDNN's bfloat16 kernels (bfloat16 weights and activations,
float32 accumulation, the output rounded to bfloat16 as the stock forward's is) where the CPU has
bfloat16 instructions (``native_dtype.bf16_refusal``): about twice the float32 rate on a matrix
product (eval/results/bf16.md). Without them oneDNN would emulate bfloat16, slower than float32,
so packing is refused and the model is better loaded in float32 (what ``--dtype auto`` does).
"""

from __future__ import annotations

import logging
import threading

import torch

from ..errors import ConfigError
from .native_dtype import bf16_refusal

log = logging.getLogger(__name__)

__all__ = ["GROUPS", "GroupMember", "PackedGroup", "PackedLinear", "pack_linears", "packed_refusal"]

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
    if p.dtype not in (torch.float32, torch.bfloat16):
        return f"the model computes in {str(p.dtype).removeprefix('torch.')}; packed linears are float32 or bfloat16"
    if not torch.backends.mkldnn.is_available() or _REORDER is None or _LINEAR is None:
        return "this torch build has no oneDNN (mkldnn) linear"
    if p.dtype == torch.bfloat16 and (why := bf16_refusal(p.device)) is not None:
        return f"the model computes in bfloat16 but {why}; load it in float32 (--dtype float32 or auto)"
    return None


def _tolerance(dtype: torch.dtype) -> float:
    """The self-check's bound: float32 rounding, or one bfloat16 rounding of the output (the packed
    and the stock bfloat16 layer both accumulate in float32 and round once, maybe to neighbours)."""
    return 1e-5 if dtype == torch.float32 else 2 * torch.finfo(dtype).eps


def _self_check(linear: torch.nn.Linear) -> float:
    """Largest |difference| between the packed and the stock layer on a fixed probe, relative to
    the output's scale."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn((3, linear.in_features), generator=g).to(linear.weight.dtype)
    with torch.inference_mode():
        want = torch.nn.functional.linear(x, linear.weight, linear.bias).float()
        got = PackedLinear(linear.weight, linear.bias)(x).float()
    return ((got - want).abs().max() / want.abs().max().clamp_min(1e-30)).item()


# sibling linears that read the same input in the stock modeling code (query/key/value of an
# attention; gate/up of a gated MLP): packed as one matrix, read in one pass
GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


class PackedGroup:
    """Linears that read the same input, packed as one [sum N, K] matrix. The first member called
    with an input computes every member's output at once; the others, called with that same
    tensor object (the stock modeling code passes one ``hidden_states`` to each), return their
    slice; a member called with another input computes afresh, so nothing else can be served a
    stale result. Fewer, larger matrix products: fewer calls and a faster decode step
    (eval/results/design_figures.md)."""

    def __init__(self, linears: list[torch.nn.Linear]):
        weight = torch.cat([m.weight.detach() for m in linears])
        biases = [m.bias for m in linears]
        bias = None if all(b is None for b in biases) else torch.cat(
            [b.detach() if b is not None else torch.zeros(m.out_features, dtype=weight.dtype)
             for b, m in zip(biases, linears)])
        self.packed = PackedLinear(weight, bias)
        ends = torch.tensor([m.out_features for m in linears]).cumsum(0).tolist()
        self.spans = list(zip([0] + ends[:-1], ends))
        # per thread (two threads may run the model): the input whose outputs are held, the outputs,
        # and how many members have yet to take their slice
        self._held = threading.local()
        # the same while dynamo traces a compiled graph: it follows a plain object's attributes (and
        # decides ``is`` between traced tensors), so the graph computes each group once
        self._traced = _Held()

    def member(self, i: int) -> "GroupMember":
        return GroupMember(self, i)

    def output(self, x: torch.Tensor, i: int) -> torch.Tensor:
        a, b = self.spans[i]
        held = self._traced if torch.compiler.is_compiling() else self._held
        if getattr(held, "x", None) is not x or held.left == 0:
            held.x, held.y, held.left = x, self.packed(x), len(self.spans)
        y = held.y
        held.left -= 1
        if held.left == 0:
            held.x = held.y = None
        return y[..., a:b]


class _Held:
    x: torch.Tensor | None = None
    y: torch.Tensor | None = None
    left: int = 0


class GroupMember:
    """The ``forward`` of one linear of a ``PackedGroup``."""

    def __init__(self, group: PackedGroup, index: int):
        self.group, self.index = group, index

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.group.output(x, self.index)


def _groups(model) -> list[list[torch.nn.Linear]]:
    """Sibling linears named as in ``GROUPS`` that take the same input size."""
    found = []
    for parent in model.modules():
        for names in GROUPS:
            members = [getattr(parent, n, None) for n in names]
            if all(isinstance(m, torch.nn.Linear) for m in members) and len({m.in_features for m in members}) == 1:
                found.append(members)
    return found


def pack_linears(model) -> int:
    """Give every ``nn.Linear`` of ``model`` a packed forward (siblings of ``GROUPS`` packed
    together); returns how many linears. Raises ConfigError naming ``packed_linear`` when the
    model cannot take it."""
    why = packed_refusal(model)
    if why is not None:
        raise ConfigError(f"RunnerConfig.packed_linear (--packed-linear): {why}")
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    if not linears:
        return 0
    dtype = linears[0].weight.dtype
    err = _self_check(linears[0])
    if not err <= _tolerance(dtype):
        raise ConfigError(f"RunnerConfig.packed_linear (--packed-linear): the packed linear differs from F.linear by {err:.2g} "
                          "(relative) on this machine; leave it off")
    n = 0
    for members in _groups(model):
        if any(_packed(m) for m in members):
            continue
        group = PackedGroup(members)
        for i, m in enumerate(members):
            m.forward = group.member(i)
            n += 1
    for m in linears:
        if not _packed(m):
            m.forward = PackedLinear(m.weight, m.bias)
            n += 1
    log.info("packed %d linear layers for oneDNN (%s)", n, str(dtype).removeprefix("torch."))
    return n


def _packed(linear: torch.nn.Linear) -> bool:
    return isinstance(linear.__dict__.get("forward"), (PackedLinear, GroupMember))
