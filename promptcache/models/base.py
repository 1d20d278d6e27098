"""The adapter contract: how position IDs reach attention for one architecture family.

An adapter wraps a stock ``transformers`` causal LM instance; it never copies model code.
Three ways positions reach attention (DESIGN.md section 5):

* rotary and learned absolute positions: the model takes ``position_ids``;
* ALiBi: the bias is built inside the model from key *indices*; the adapter installs forward
  pre-hooks on the model's blocks (per instance) that replace that one tensor with one built
  from our key positions. The hooks read a thread-local context set only inside
  ``Adapter.forward``; outside it the model behaves exactly as stock.
"""

from __future__ import annotations

import math
import threading
from contextlib import contextmanager
from dataclasses import dataclass
from typing import ClassVar

import torch


@dataclass(frozen=True)
class KVSpec:
    """Shape of one token's key/value states: per layer, K and V of [kv_heads, head_dim]."""

    layers: int
    kv_heads: int
    head_dim: int
    dtype: torch.dtype

    @property
    def bytes_per_token(self) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * torch.empty((), dtype=self.dtype).element_size()


class UnsupportedModelError(ValueError):
    """The architecture (or one of its settings) has not been verified for exact splicing."""


class Adapter:
    """Base adapter. Subclasses set ``model_types`` and ``positional`` and may override the hooks."""

    model_types: ClassVar[tuple[str, ...]] = ()
    positional: ClassVar[str] = "rotary"  # "rotary" | "alibi" | "learned"
    passes_position_ids: ClassVar[bool] = True

    def __init__(self, model):
        self.model = model
        self.config = model.config
        self._ctx = threading.local()
        self.check_config()

    @classmethod
    def select(cls, config) -> type["Adapter"]:
        """The concrete adapter class for this config (a family may have variants)."""
        return cls

    # -- shapes --------------------------------------------------------------------------------
    def kv_heads(self) -> int:
        c = self.config
        return getattr(c, "num_key_value_heads", None) or c.num_attention_heads

    def head_dim(self) -> int:
        c = self.config
        return getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads

    def kv_spec(self) -> KVSpec:
        dtype = next(self.model.parameters()).dtype
        return KVSpec(self.config.num_hidden_layers, self.kv_heads(), self.head_dim(), dtype)

    # -- checks --------------------------------------------------------------------------------
    def check_config(self) -> None:
        """Refuse settings under which splicing is not exact."""

    def max_position(self) -> int | None:
        """Largest position ID the model can take (None: unbounded)."""
        return None

    def max_entries(self) -> int | None:
        """Most key/value entries one forward may attend to exactly (None: unbounded)."""
        return None

    def check_limits(self, max_pos: int, entries: int) -> None:
        limit = self.max_position()
        if limit is not None and max_pos > limit:
            raise UnsupportedModelError(
                f"position {max_pos} is beyond what this {self.config.model_type} model supports "
                f"(largest position {limit}); use a shorter schema"
            )
        window = self.max_entries()
        if window is not None and entries > window:
            raise UnsupportedModelError(
                f"{entries} key/value entries exceed this model's sliding attention window ({window}); "
                "splicing is exact only inside the window"
            )

    # -- forward -------------------------------------------------------------------------------
    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, cache) -> torch.Tensor:
        """Run new tokens on top of ``cache`` (a ``SpliceCache`` whose ``positions`` hold the key
        position of every entry). input_ids, position_ids: [B, T]. Returns last-token logits [B, V]."""
        cache.stage_positions(position_ids)
        kwargs = {"position_ids": position_ids} if self.passes_position_ids else {}
        with self._positions(cache.key_positions(position_ids.shape[1])):
            out = self.model(input_ids=input_ids, past_key_values=cache, use_cache=True, logits_to_keep=1, **kwargs)
        return out.logits[:, -1, :]

    @contextmanager
    def _positions(self, key_positions: torch.Tensor):
        """Make key positions [B, kv_len] visible to the ALiBi hooks for one forward."""
        prev = getattr(self._ctx, "state", None)
        self._ctx.state = {"key_positions": key_positions}
        try:
            yield
        finally:
            self._ctx.state = prev

    def _state(self) -> dict | None:
        return getattr(self._ctx, "state", None)

    # -- relocation (position-independent modules) ---------------------------------------------
    def can_relocate(self) -> bool:
        """Whether stored states can be moved to new positions exactly (``relocate.py``)."""
        from .relocate import can_relocate  # relocate.py builds on this module

        return can_relocate(self)


class RotaryAdapter(Adapter):
    positional = "rotary"

    def rope_parameters(self) -> dict:
        rp = getattr(self.config, "rope_parameters", None) or {}
        return rp if "rope_type" in rp or "rope_theta" in rp else {}

    def check_config(self) -> None:
        sw = getattr(self.config, "sliding_window", None)
        if sw is not None and getattr(self.config, "use_sliding_window", True):
            self._sliding_window = int(sw)
        else:
            self._sliding_window = None

    def max_position(self) -> int | None:
        rp = self.rope_parameters()
        if rp.get("rope_type") in ("dynamic", "longrope"):
            # these recompute frequencies from the largest position in each forward: exact only
            # while every position stays below the original context length
            orig = rp.get("original_max_position_embeddings") or self.config.max_position_embeddings
            return orig - 1
        return None

    def max_entries(self) -> int | None:
        # the sliding-window mask counts cache entries, not positions: stay inside the window
        return self._sliding_window


class LearnedAdapter(Adapter):
    positional = "learned"

    def max_position(self) -> int | None:
        return self.config.max_position_embeddings - 1


class AlibiAdapter(Adapter):
    """ALiBi families: per-instance block pre-hooks replace the bias built from key indices."""

    positional = "alibi"
    passes_position_ids = False

    def __init__(self, model):
        super().__init__(model)
        self.slopes = self.alibi_slopes().float()  # [H]
        for block in self.blocks():
            block.register_forward_pre_hook(self._hook, with_kwargs=True)

    def blocks(self):
        raise NotImplementedError

    def alibi_slopes(self) -> torch.Tensor:
        raise NotImplementedError

    def _hook(self, module, args, kwargs):
        state = self._state()
        if state is None:
            return None
        if "bias" not in state:
            state["bias"] = self.bias_kwargs(state["key_positions"], kwargs)
        kwargs.update(state["bias"])
        return args, kwargs

    def bias_kwargs(self, key_positions: torch.Tensor, kwargs: dict) -> dict:
        raise NotImplementedError


def scaled_mask(alibi: torch.Tensor, causal: torch.Tensor, scale: float) -> torch.Tensor:
    """Falcon-style merged mask: alibi / sqrt(head_dim) where visible, dtype min where masked."""
    min_dtype = torch.finfo(causal.dtype).min
    return torch.masked_fill(alibi / math.sqrt(scale), causal < -1, min_dtype)
