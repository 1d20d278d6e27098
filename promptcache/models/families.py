"""Per-family adapters and their registry. An architecture not listed here is refused."""

from __future__ import annotations

import math
import weakref

import torch

from .masks import additive as additive_mask
from .base import Adapter, UnsupportedModelError
from transformers.models.falcon import modeling_falcon

from .kinds import AlibiAdapter, LayerTypeRopes, LearnedAdapter, RotaryAdapter, scaled_mask

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
class Gemma3Text(LayerTypeRopes):
    """Gemma 3 (text): local layers (a sliding window, ``config.sliding_window`` positions, RoPE base
    10K) and every ``sliding_window_pattern``-th layer global (RoPE base 1M), as
    ``config.layer_types`` names them; keys and queries RMS-normalised and the query scaled by
    ``query_pre_attn_scalar`` inside the model's own attention module (the engine's attention
    takes the module's ``scaling``). Windows apply by position ID on the pool (``paged.KeyRule``)."""

    model_types = ("gemma3_text",)
    windows_by_position = True

    def max_entries(self) -> int | None:
        return None  # windows apply by position ID in every forward (layer_mask_kwargs)

    def layer_mask_kwargs(self, mask, key_positions, position_ids):
        """One mask per layer type (the model takes a dict keyed by ``config.layer_types``' names):
        ``mask`` for global layers, and for sliding ones ``mask`` and keys at positions above the
        query's minus the window (transformers' ``kv_idx > q_idx - window``, in position IDs)."""
        masks = {}
        types = self.config.layer_types
        for kind, window in zip(types, self.sliding_windows() or [None] * len(types)):
            if kind not in masks:
                seen = mask if window is None else \
                    mask & (key_positions[:, None, None, :] > position_ids[:, None, :, None] - window)
                masks[kind] = self.mask_kwargs(seen)["attention_mask"]
        return {"attention_mask": masks}

    def check_config(self) -> None:
        super().check_config()
        c = self.config
        if getattr(c, "attn_logit_softcapping", None) is not None:
            raise UnsupportedModelError(f"Gemma 3 with attn_logit_softcapping={c.attn_logit_softcapping} is not "
                                        "supported (the engine's attention applies no soft-capping)")
        if getattr(c, "use_bidirectional_attention", False):
            raise UnsupportedModelError("Gemma 3 with use_bidirectional_attention=True is not a causal LM")
        if getattr(c, "layer_types", None) is None:
            raise UnsupportedModelError("a gemma3_text config without layer_types (which layers slide)")


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
    """Falcon's shapes and its attention modules (both variants compute attention inline)."""

    def kv_heads(self) -> int:
        c = self.config
        if c.new_decoder_architecture:  # the model stores keys already expanded to every head
            return c.num_attention_heads
        return 1 if c.multi_query else c.num_kv_heads

    def head_dim(self) -> int:
        return self.config.hidden_size // self.config.num_attention_heads

    # Falcon computes attention inline (both variants): paged forwards go through paged_attention
    inline_attention = True

    def attention_modules(self):
        return [b.self_attention for b in self.model.transformer.h]

    def paged_qkv(self, module, hidden_states, kwargs):
        b, t, _ = hidden_states.shape
        fused = module.query_key_value(hidden_states)
        heads, d = module.num_heads, module.head_dim
        if module.new_decoder_architecture:  # keys and values broadcast to every head of their group
            kvh = module.num_kv_heads
            qkv = fused.view(b, t, kvh, heads // kvh + 2, d)
            q = qkv[:, :, :, :-2].reshape(b, t, heads, d)
            k, v = (qkv[:, :, :, i : i + 1].expand(b, t, kvh, heads // kvh, d).reshape(b, t, heads, d)
                    for i in (heads // kvh, heads // kvh + 1))
        elif module.multi_query:
            qkv = fused.view(b, t, heads + 2, d)
            q, k, v = qkv[:, :, :-2], qkv[:, :, -2:-1], qkv[:, :, -1:]
        else:
            qkv = fused.view(b, t, heads, 3, d)
            q, k, v = qkv[..., 0, :], qkv[..., 1, :], qkv[..., 2, :]
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        if kwargs.get("alibi") is None:  # the rotary variant: rotated as the module does
            cos, sin = kwargs["position_embeddings"]
            q, k = modeling_falcon.apply_rotary_pos_emb(q, k, cos, sin)
        return q, k, v, kwargs.get("layer_past"), module.inv_norm_factor

    def paged_output(self, module, context, hidden_states, kwargs):
        return module.dense(context), None


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

    def paged_bias(self, key_positions):
        # bfloat16 slopes times positions, as the model builds its alibi; it merges alibi / sqrt(head_dim)
        # into its float mask, and its eager attention also adds alibi to the scores before scaling them
        dtype = self.kv_spec().dtype
        alibi = (self.slopes.to(key_positions.device).bfloat16()[:, None] * key_positions[None, :]).to(dtype)
        scale = 1 / math.sqrt(self.head_dim())
        merged = (alibi / math.sqrt(self.head_dim())).float()
        return merged if self.attn_implementation() == "sdpa" else alibi.float() * scale + merged



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

    def attention_modules(self):
        return [b.self_attention for b in self.model.transformer.h]

    def paged_bias(self, key_positions):
        slopes = self.slopes.to(key_positions.device)
        return (slopes[:, None] * key_positions[None, :].float()).to(self.kv_spec().dtype).float()

    def paged_qkv(self, module, hidden_states, kwargs):
        b, t, _ = hidden_states.shape
        qkv = module.query_key_value(hidden_states).view(b, t, module.num_heads, 3, module.head_dim)
        q, k, v = (qkv[..., i, :].transpose(1, 2) for i in range(3))
        return q, k, v, kwargs.get("layer_past"), module.inv_norm_factor

    def paged_output(self, module, context, hidden_states, kwargs):
        # Bloom's attention adds the residual itself (its slow_but_exact tensor-parallel sum is one
        # matrix product here: the same up to rounding, which the self-check bounds)
        out = torch.nn.functional.dropout(module.dense(context), p=module.hidden_dropout, training=module.training)
        return out + kwargs["residual"], None


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

    def attention_modules(self):
        return [b.attn for b in self.model.transformer.blocks]

    def paged_bias(self, key_positions):
        # float32 as MPT builds it; MPT subtracts the last key's position, a per-query constant
        return self.slopes.to(key_positions.device)[:, None] * key_positions[None, :].float()

    def paged_qkv(self, module, hidden_states, kwargs):
        b, t, _ = hidden_states.shape
        mixed = module.Wqkv(hidden_states)
        if module.clip_qkv:
            mixed = mixed.clamp(min=-module.clip_qkv, max=module.clip_qkv)
        q, k, v = (x.reshape(b, t, module.n_heads, module.head_dim).transpose(1, 2) for x in mixed.chunk(3, dim=2))
        return q, k, v, kwargs.get("past_key_values"), module.softmax_scale

    def paged_output(self, module, context, hidden_states, kwargs):
        return module.out_proj(context), None
