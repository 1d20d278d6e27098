"""Per-family adapters and their registry. An architecture not listed here is refused."""

from __future__ import annotations

import torch

from .base import Adapter, AlibiAdapter, LearnedAdapter, RotaryAdapter, UnsupportedModelError, scaled_mask

REGISTRY: dict[str, type[Adapter]] = {}


def register(cls: type[Adapter]) -> type[Adapter]:
    for t in cls.model_types:
        REGISTRY[t] = cls
    return cls


def supported_model_types() -> list[str]:
    return sorted(REGISTRY)


def get_adapter(model) -> Adapter:
    """The adapter for a loaded model (created once per model instance)."""
    existing = getattr(model, "_promptcache_adapter", None)
    if existing is not None:
        return existing
    model_type = getattr(model.config, "model_type", None)
    cls = REGISTRY.get(model_type)
    if cls is None:
        raise UnsupportedModelError(
            f"model type '{model_type}' is not supported (verified: {', '.join(supported_model_types())})"
        )
    adapter = cls.select(model.config)(model)
    model._promptcache_adapter = adapter
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

    def blocks(self):
        return self.model.transformer.h

    def alibi_slopes(self) -> torch.Tensor:
        from transformers.models.falcon import modeling_falcon

        ones = torch.ones((1, 2), dtype=torch.long)
        return modeling_falcon.build_alibi_tensor(ones, self.config.num_attention_heads, torch.float32)[:, 0, 1]

    def bias_kwargs(self, key_positions, kwargs):
        b, kv = key_positions.shape
        h = self.config.num_attention_heads
        old_mask, dtype = kwargs["attention_mask"], kwargs["alibi"].dtype
        # the model multiplies bfloat16 slopes by positions; do the same so contiguous runs match it
        slopes = self.slopes.to(key_positions.device).bfloat16()
        alibi = (slopes[None, :, None] * key_positions[:, None, :]).reshape(b, h, 1, kv).to(dtype)
        mask = scaled_mask(alibi, old_mask, self.config.hidden_size // h)
        return {"alibi": alibi, "attention_mask": mask}


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

    def bias_kwargs(self, key_positions, kwargs):
        b, kv = key_positions.shape
        slopes = self.slopes.to(key_positions.device)
        alibi = slopes[None, :, None] * key_positions[:, None, :].float()  # [B, H, kv]
        return {"alibi": alibi.reshape(-1, 1, kv).to(kwargs["alibi"].dtype)}


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

    def bias_kwargs(self, key_positions, kwargs):
        if key_positions.shape[0] > 1 and not bool((key_positions == key_positions[:1]).all()):
            raise UnsupportedModelError("MPT batches need equal key positions in every row")
        kp = key_positions[0].float()
        slopes = self.slopes.to(kp.device)
        bias = slopes[:, None, None] * (kp - kp.max())[None, None, :]  # [H, 1, kv], <= 0 as in MPT
        return {"position_bias": bias}
