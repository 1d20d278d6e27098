"""Per-family adapters and their registry. An architecture not listed here is refused."""

from __future__ import annotations

import weakref

import torch

from .masks import additive as additive_mask
from .base import Adapter, UnsupportedModelError
from .kinds import AlibiAdapter, LearnedAdapter, RotaryAdapter, scaled_mask

REGISTRY: dict[str, type[Adapter]] = {}


def register(cls: type[Adapter]) -> type[Adapter]:
    for t in cls.model_types:
        REGISTRY[t] = cls
    return cls


# id(model) -> its adapter, while the adapter lives (the adapter holds the model, so a weak map keyed
# by the model itself would never let go; the ``is`` check above guards against a reused id).
_ADAPTERS: "weakref.WeakValueDictionary[int, Adapter]" = weakref.WeakValueDictionary()


def supported_model_types() -> list[str]:
    return sorted(REGISTRY)


def adapter_class(config) -> type[Adapter]:
    """The adapter class for a model config, without the model: an unsupported ``model_type`` is
    refused (``UnsupportedModelError`` listing the verified ones) before any weights are loaded.
    Settings checked on the instance (``Adapter.check_config``, the self-check) come with ``get_adapter``."""
    model_type = getattr(config, "model_type", None)
    cls = REGISTRY.get(model_type)
    if cls is None:
        raise UnsupportedModelError(
            f"model type '{model_type}' is not supported (verified: {', '.join(supported_model_types())})"
        )
    return cls.select(config)


def get_adapter(model) -> Adapter:
    """The adapter for a loaded model, created and self-checked once per model instance
    (``Adapter.self_check``); a model that fails the check is refused (``UnsupportedModelError``)."""
    existing = _ADAPTERS.get(id(model))
    if existing is not None and existing.model is model:
        return existing
    adapter = adapter_class(model.config)(model)
    try:
        adapter.self_check()
    except Exception:
        adapter.close()
        raise
    _ADAPTERS[id(model)] = adapter
    return adapter


@register
class LlamaFamily(RotaryAdapter):
    """Llama, Mistral, Qwen2, Qwen3, Phi-3: rotary embeddings fed by ``position_ids``."""

    model_types = ("llama", "mistral", "qwen2", "qwen3", "phi3")


@register
class GPTNeoX(RotaryAdapter):
    """GPT-NeoX: partial rotary (``partial_rotary_factor``); positions via ``position_ids``."""

    model_types = ("gpt_neox",)

    def kv_heads(self) -> int:
        return self.config.num_attention_heads


@register
class GPT2(LearnedAdapter):
    model_types = ("gpt2",)

    def kv_heads(self) -> int:
        return self.config.num_attention_heads


@register
class OPT(LearnedAdapter):
    model_types = ("opt",)

    def kv_heads(self) -> int:
        return self.config.num_attention_heads


class _FalconShapes:
    def kv_heads(self) -> int:
        c = self.config
        if c.new_decoder_architecture:  # the model stores keys already expanded to every head
            return c.num_attention_heads
        return 1 if c.multi_query else c.num_kv_heads

    def head_dim(self) -> int:
        return self.config.hidden_size // self.config.num_attention_heads


class FalconRotary(_FalconShapes, RotaryAdapter):
    pass


class FalconAlibi(_FalconShapes, AlibiAdapter):
    """Falcon with ``alibi=True``: the model merges alibi / sqrt(head_dim) into its float mask and
    passes the raw alibi too; the hook replaces both."""

    relocation = None
    relocation_refusal = (
        "cannot relocate states of a Falcon ALiBi model: Falcon computes its ALiBi bias as bfloat16 "
        "slope * absolute position (8 significant bits, even in float32 models), so its states depend "
        "on absolute positions through rounding and moving them is not exact; re-encode the span at "
        "its new positions instead"
    )

    def blocks(self):
        return self.model.transformer.h

    def alibi_slopes(self) -> torch.Tensor:
        from transformers.models.falcon import modeling_falcon

        ones = torch.ones((1, 2), dtype=torch.long)
        return modeling_falcon.build_alibi_tensor(ones, self.config.num_attention_heads, torch.float32)[:, 0, 1]

    bias_args = ("alibi", "attention_mask")

    def bias_kwargs(self, key_positions, kwargs, mask=None):
        b, kv = key_positions.shape
        h = self.config.num_attention_heads
        dtype = kwargs["alibi"].dtype
        # [B|1, 1, T, kv] float: the model's merged mask, or our mask made additive
        old_mask = kwargs["attention_mask"] if mask is None else additive_mask(mask, dtype)
        # the model multiplies bfloat16 slopes by positions; do the same so contiguous runs match it
        slopes = self.slopes.to(key_positions.device).bfloat16()
        alibi = (slopes[None, :, None] * key_positions[:, None, :]).reshape(b, h, 1, kv).to(dtype)
        merged = scaled_mask(alibi, old_mask, self.config.hidden_size // h)  # [B, H, T, kv]
        return {"alibi": alibi, "attention_mask": merged}


@register
class Falcon(Adapter):
    """Dispatches to the rotary or the ALiBi variant from ``config.alibi``."""

    model_types = ("falcon",)

    @classmethod
    def select(cls, config):
        return FalconAlibi if config.alibi else FalconRotary


@register
class Bloom(AlibiAdapter):
    model_types = ("bloom",)

    def blocks(self):
        return self.model.transformer.h

    def kv_heads(self) -> int:
        return self.config.num_attention_heads

    def alibi_slopes(self) -> torch.Tensor:
        ones = torch.ones((1, 2), dtype=torch.long)
        t = self.model.transformer.build_alibi_tensor(ones, self.config.num_attention_heads, torch.float32)
        return t[:, 0, 1]

    bias_args = ("alibi",)

    def bias_kwargs(self, key_positions, kwargs, mask=None):
        b, kv = key_positions.shape
        dtype = kwargs["alibi"].dtype
        slopes = self.slopes.to(key_positions.device)
        alibi = slopes[None, :, None] * key_positions[:, None, :].float()  # [B, H, kv]
        out = {"alibi": alibi.reshape(-1, 1, kv).to(dtype)}  # [B * H, 1, kv], as Bloom builds it
        if mask is not None:  # Bloom's attention adds a float mask to its scores
            out["attention_mask"] = additive_mask(mask, dtype)
        return out


@register
class MPT(AlibiAdapter):
    """MPT's bias is [H, 1, kv], shared by the batch: batched forwards need equal key positions."""

    model_types = ("mpt",)

    def check_config(self) -> None:
        if not self.config.attn_config.alibi:
            raise UnsupportedModelError("MPT without alibi is not supported (no verified position path)")

    def blocks(self):
        return self.model.transformer.blocks

    def kv_heads(self) -> int:
        return self.config.num_attention_heads

    def alibi_slopes(self) -> torch.Tensor:
        t = self.model.transformer.build_mpt_alibi_tensor(self.config.num_attention_heads, 2)
        return -t[:, 0, 0]

    bias_args = ("position_bias",)

    @property
    def max_positions(self) -> int | None:
        return self.config.max_seq_len  # the stock bias is built for this many keys

    def bias_kwargs(self, key_positions, kwargs, mask=None):
        if key_positions.shape[0] > 1 and not bool((key_positions == key_positions[:1]).all()):
            raise UnsupportedModelError("MPT batches need equal key positions in every row")
        kp = key_positions[0].float()
        slopes = self.slopes.to(kp.device)
        bias = slopes[:, None, None] * (kp - kp.max())[None, None, :]  # [H, 1, kv], <= 0 as in MPT
        out = {"position_bias": bias}
        if mask is not None:  # MPT's attention takes a bool mask, True = masked
            out["attention_mask"] = ~mask
        return out
