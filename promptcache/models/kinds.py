"""The three ways positions reach attention, one ``Adapter`` subclass each (see ``base.py``).

* ``RotaryAdapter``: ``position_ids`` drive the model's own rotary embedding; ``rope_spec`` reads
  the frequencies it applies (relocation rotates stored keys by them).
* ``LearnedAdapter``: ``position_ids`` index a learned embedding; stored states cannot move.
* ``AlibiAdapter``: per-instance block pre-hooks replace the bias the model builds from key
  indices with one built from our key positions, and, for a custom mask, the block's mask. Each
  hook checks that every keyword argument it replaces is in the block call, and every forward
  checks that every hook ran: a transformers release that renames an argument or a block is an
  error, never a silent fall-back to the stock bias.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch
import transformers

from .base import Adapter, UnsupportedModelError

_STATIC_ROPES = ("default", "linear", "llama3", "yarn")  # inv_freq fixed at init
_BOUNDED_ROPES = ("dynamic", "longrope")  # original inv_freq below the adapter's max_position


@dataclass(frozen=True)
class RopeSpec:
    """The rotary frequencies one model applies to its keys."""

    # [rotary_dim // 2], or [layers, rotary_dim // 2] where layers differ (Gemma 3: a base per layer
    # type); float64 on CPU: the model's own float32 values
    inv_freq: torch.Tensor
    rope_type: str

    @property
    def rotary_dim(self) -> int:
        """Leading channels of each head that are rotated; ``head_dim - rotary_dim`` pass through."""
        return 2 * self.inv_freq.shape[-1]


class RotaryAdapter(Adapter):
    positional = "rotary"
    relocation = "rotate_keys"

    def rope_parameters(self) -> dict:
        rp = getattr(self.config, "rope_parameters", None) or {}
        return rp if "rope_type" in rp or "rope_theta" in rp else {}

    def check_config(self) -> None:
        sw = getattr(self.config, "sliding_window", None)
        if sw is not None and getattr(self.config, "use_sliding_window", True):
            self._sliding_window = int(sw)
        else:
            self._sliding_window = None

    def _bounded_context(self) -> int | None:
        """The original context of ropes whose frequencies change with the largest position."""
        rp = self.rope_parameters()
        if rp.get("rope_type") in _BOUNDED_ROPES:
            return rp.get("original_max_position_embeddings") or self.config.max_position_embeddings
        return None

    @property
    def max_positions(self) -> int | None:
        return self._bounded_context() or super().max_positions

    def max_position(self) -> int | None:
        # dynamic / longrope recompute frequencies from the largest position in each forward:
        # exact only while every position stays below the original context length
        orig = self._bounded_context()
        return None if orig is None else orig - 1

    def max_entries(self) -> int | None:
        # the sliding-window mask counts cache entries, not positions: stay inside the window
        return self._sliding_window

    def sliding_windows(self) -> list[int | None] | None:
        """The window of each layer: every layer's, or those ``config.layer_types`` names
        ``"sliding_attention"`` (Qwen2/Qwen3 from ``max_window_layers`` on)."""
        if self._sliding_window is None:
            return None
        types = getattr(self.config, "layer_types", None)
        if types is None:
            return [self._sliding_window] * self.config.num_hidden_layers
        return [self._sliding_window if t == "sliding_attention" else None for t in types]

    def rope_spec(self) -> RopeSpec:
        """The model's rotary frequencies, read from its own rotary module; refuses rope settings
        under which rotating stored keys is not exact."""
        rotary = _rotary_module(self.model)
        rope_type = getattr(rotary, "rope_type", "default")
        if not isinstance(rope_type, str):  # per-layer-type ropes (a dict): a family that reads them says how
            return self.layer_rope_spec(rotary)
        if rope_type in _STATIC_ROPES:
            inv_freq = rotary.inv_freq
        elif rope_type in _BOUNDED_ROPES:
            if self.max_position() is None:  # the bound below which original frequencies hold
                raise UnsupportedModelError(f"cannot relocate: rope type '{rope_type}' without a position limit")
            inv_freq = rotary.original_inv_freq
        else:
            raise UnsupportedModelError(
                f"cannot relocate: rope type '{rope_type}' is not verified "
                f"(verified: {', '.join(_STATIC_ROPES + _BOUNDED_ROPES)})"
            )
        return RopeSpec(inv_freq.detach().to("cpu", torch.float64), rope_type)

    def layer_rope_spec(self, rotary) -> RopeSpec:
        """The rope of a model whose rotary module holds frequencies per layer type (``rope_type``
        a dict); refused unless a family reads them (``LayerTypeRopes``)."""
        raise UnsupportedModelError(f"cannot relocate: per-layer rope types {rotary.rope_type!r} are not verified")

    def check_relocatable(self) -> None:
        spec = self.rope_spec()
        if spec.rotary_dim > self.head_dim():
            raise UnsupportedModelError(f"rotary dim {spec.rotary_dim} exceeds head_dim {self.head_dim()}")


class LearnedAdapter(Adapter):
    positional = "learned"

    @property
    def relocation_refusal(self) -> str:
        return (
            f"cannot relocate states of this {self.config.model_type} model: it uses learned absolute "
            "position embeddings, added to the token embeddings before the first layer, so every key and "
            "value mixes in its position nonlinearly and there is no exact way to move them; "
            "re-encode the span at its new positions instead"
        )

    def max_position(self) -> int | None:
        return self.config.max_position_embeddings - 1


class AlibiAdapter(Adapter):
    """ALiBi families. Subclasses name their blocks, slopes, the block keyword arguments their
    bias replaces (``bias_args``) and build the replacements (``bias_kwargs``). They compute
    attention inline: paged forwards reach it through ``Adapter.paged_attention``, and the
    paged attention adds ``paged_bias`` of the key positions."""

    positional = "alibi"
    passes_position_ids = False
    inline_attention = True
    relocation = "positions_only"
    bias_args: ClassVar[tuple[str, ...]] = ()  # block kwargs replaced on every forward
    mask_arg: ClassVar[str] = "attention_mask"  # block kwarg replaced when a custom mask is given

    def __init__(self, model):
        super().__init__(model)
        self.slopes = self.alibi_slopes().float()  # [H]
        self._blocks = list(self.blocks())
        self._handles = [b.register_forward_pre_hook(self._hook, with_kwargs=True) for b in self._blocks]

    def close(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

    def blocks(self):
        raise NotImplementedError

    def alibi_slopes(self) -> torch.Tensor:
        raise NotImplementedError

    def bias_kwargs(self, key_positions: torch.Tensor, kwargs: dict, mask: torch.Tensor | None = None) -> dict:
        """Replacements for ``bias_args`` (and ``mask_arg`` when ``mask``, bool [B|1, 1, T, kv], is
        given) built from key positions [B, kv]."""
        raise NotImplementedError

    def mask_kwargs(self, mask: torch.Tensor) -> dict:
        return {}  # the hooks replace the block's mask

    def _hook(self, module, args, kwargs):
        state = self._state()
        if state is None:
            return None
        mask = state["mask"]
        replaced = self.bias_args + ((self.mask_arg,) if mask is not None else ())
        missing = [name for name in replaced if name not in kwargs]
        if missing:
            raise UnsupportedModelError(
                f"the ALiBi hook of {type(self).__name__} replaces the block keyword argument(s) "
                f"{', '.join(repr(m) for m in missing)}, but transformers {transformers.__version__} does not pass "
                f"them (it passes: {', '.join(sorted(kwargs))}); this transformers version is not supported"
            )
        if "bias" not in state:
            state["bias"] = self.bias_kwargs(state["key_positions"], kwargs, mask)
        state["calls"] += 1
        kwargs.update(state["bias"])
        return args, kwargs

    def paged_bias(self, key_positions: torch.Tensor) -> torch.Tensor:
        """The ALiBi term [H, n] (float32) this model adds to its scaled attention scores for keys
        at ``key_positions`` [n], rounded as the model rounds it (a per-query constant left out:
        softmax ignores it)."""
        raise NotImplementedError

    def verify_forward(self, state: dict) -> None:
        if state["calls"] != len(self._blocks):
            raise UnsupportedModelError(
                f"the ALiBi hooks of {type(self).__name__} ran {state['calls']} times for {len(self._blocks)} "
                f"blocks (transformers {transformers.__version__}): the model no longer calls the hooked blocks "
                "as expected; this transformers version is not supported"
            )


class LayerTypeRopes(RotaryAdapter):
    """A rotary family whose one rotary module holds frequencies per layer type
    (``{type}_inv_freq`` beside ``rope_type = {type: kind}``, e.g. Gemma 3: local layers at base
    10K, global ones at 1M) and whose layers each apply their type's (``config.layer_types``):
    relocation rotates each layer's keys by its own frequencies."""

    def layer_rope_spec(self, rotary) -> RopeSpec:
        kinds = rotary.rope_type
        odd = {t: k for t, k in kinds.items() if k not in _STATIC_ROPES}
        if odd:
            raise UnsupportedModelError(f"cannot relocate: rope type(s) {odd} are not verified "
                                        f"(verified per layer type: {', '.join(_STATIC_ROPES)})")
        types = list(self.config.layer_types)
        missing = sorted(set(types) - set(kinds))
        if missing:
            raise UnsupportedModelError(f"cannot relocate: layer type(s) {missing} have no rope in the rotary module")
        per_type = {t: getattr(rotary, f"{t}_inv_freq").detach().to("cpu", torch.float64) for t in kinds}
        inv_freq = torch.stack([per_type[t] for t in types])  # [layers, rotary_dim // 2]
        return RopeSpec(inv_freq, "/".join(f"{t}:{k}" for t, k in sorted(kinds.items())))


def scaled_mask(alibi: torch.Tensor, causal: torch.Tensor, scale: float) -> torch.Tensor:
    """Falcon-style merged mask: alibi / sqrt(head_dim) where visible, dtype min where masked."""
    min_dtype = torch.finfo(causal.dtype).min
    return torch.masked_fill(alibi / math.sqrt(scale), causal < -1, min_dtype)


def _rotary_module(model) -> torch.nn.Module:
    found = [m for m in model.modules() if type(m).__name__.endswith("RotaryEmbedding")]
    if len(found) != 1:
        raise UnsupportedModelError(
            f"cannot relocate: expected one rotary embedding module in this {model.config.model_type} "
            f"model, found {len(found)}"
        )
    return found[0]
