"""The rotary frequencies vLLM's model applies, from the Hugging Face config vLLM loaded.

The connector moves a stored key from position ``p`` to ``p + d`` by rotating it ``d`` positions
(``states.rotated``), so it needs the frequencies vLLM's own rotary embedding uses for the same
config. ``rope_inv_freq(config)`` computes them as vLLM 0.32's ``get_rope`` does
(``vllm/model_executor/layers/rotary_embedding``), torch only, so both the connector and the
tests without vLLM use one function:

* ``default``: ``base ** (-2i / rotary_dim)``;
* ``linear``: the default frequencies over ``factor`` (vLLM divides the positions instead:
  the same angles, rounded once differently);
* ``llama3``: low frequencies divided by ``factor``, high ones kept, a smooth ramp between
  (``low_freq_factor``, ``high_freq_factor``, ``original_max_position_embeddings``);
* ``yarn``: interpolated and extrapolated frequencies mixed by a linear ramp over the correction
  range of ``beta_fast`` / ``beta_slow`` (``truncate``), at ``original_max_position_embeddings``.

YaRN also scales cos and sin by an attention factor (``attention_scaling``: ``attention_factor``,
or ``mscale`` / ``mscale_all_dim``, or ``0.1 ln(factor) + 1``), on queries and keys alike. A stored
key already carries it once (promptcache's engine computes it with transformers' equal formula),
and rotations compose without it: ``rotated`` never applies it again.

Refused, named (``SupplyError``; the connector then computes every request in full): rope
parameters per layer type (Gemma 3's local and global ropes: one offset would need one rotation
per layer type, and vLLM's connector writes layers without knowing their type here), ``dynamic``
(vLLM fixes its NTK base at the full context while transformers recomputes it from each forward's
length: the two sides' keys differ before any move), ``longrope`` (vLLM switches frequency sets at
a position, transformers per forward length) and every other kind (not reproduced here).
"""

from __future__ import annotations

import math

import torch

from .supply import SupplyError

__all__ = ["ROPES", "attention_scaling", "rope_inv_freq", "rope_parameters"]

ROPES = ("default", "linear", "llama3", "yarn")  # the kinds whose frequencies the connector reproduces

_REFUSED = {
    "dynamic": "vLLM's 'dynamic' rope fixes its NTK base at the model's full context, while transformers (the "
               "engine that stored the states) recomputes it from each forward's length: the keys differ before any "
               "move",
    "longrope": "vLLM's 'longrope' switches from the short to the long factors at a position, transformers by each "
                "forward's length: the two sides' keys differ past the original context",
}


def rope_parameters(config) -> dict:
    """The config's rope parameters as one flat dict with ``rope_type`` and ``rope_theta``;
    ``SupplyError`` for a model without rotary positions or with ropes per layer type."""
    params = getattr(config, "rope_parameters", None) or {}
    scaling = getattr(config, "rope_scaling", None) or {}
    types = set(getattr(config, "layer_types", None) or ())
    nested = sorted(k for k, v in params.items() if k in types or isinstance(v, dict))
    if nested:
        kinds = {k: (params[k] or {}).get("rope_type", "default") for k in nested}
        raise SupplyError(f"{getattr(config, 'model_type', 'this model')} has a rope per layer type ({kinds}): the "
                          "vLLM connector rotates every layer's keys alike and does not support per-layer ropes")
    merged = {**scaling, **params}
    merged["rope_type"] = merged.get("rope_type") or merged.get("type") or "default"
    if merged.get("rope_theta") is None:
        merged["rope_theta"] = getattr(config, "rope_theta", None)
    if merged["rope_theta"] is None:
        raise SupplyError(f"{getattr(config, 'model_type', 'this model')} has no rotary embedding (rope_theta)")
    return merged


def _rotary_dim(config, params: dict) -> int:
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    if params.get("rope_dim"):
        return int(params["rope_dim"])
    factor = params.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", None) or 1.0)
    return int(head_dim * factor)


def rope_inv_freq(config) -> torch.Tensor:
    """The rotary frequencies [rotary_dim / 2] (float32) vLLM's model applies for ``config``;
    ``SupplyError`` naming a rope the connector does not reproduce."""
    params = rope_parameters(config)
    kind = params["rope_type"]
    if kind not in ROPES:
        reason = _REFUSED.get(kind, f"not reproduced here (supported: {', '.join(ROPES)})")
        raise SupplyError(f"rope type '{kind}' is not supported by the vLLM connector: {reason}")
    if "mrope_section" in params:
        raise SupplyError(f"a multimodal rope (mrope_section, rope type '{kind}') is not supported by the vLLM "
                          "connector")
    base, dim = float(params["rope_theta"]), _rotary_dim(config, params)
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
    if kind == "linear":
        return inv_freq / params["factor"]
    if kind == "llama3":
        return _llama3(inv_freq, params["factor"], params["low_freq_factor"], params["high_freq_factor"],
                       params["original_max_position_embeddings"])
    if kind == "yarn":
        return _yarn(base, dim, params)
    return inv_freq


def attention_scaling(config) -> float:
    """The factor vLLM multiplies cos and sin by (YaRN's attention scaling; 1.0 for the other
    ropes). Stored keys carry it once already; a rotation does not apply it again."""
    params = rope_parameters(config)
    if params["rope_type"] != "yarn":
        return 1.0
    factor = params["factor"]
    if params.get("attention_factor") is not None:
        return float(params["attention_factor"])
    if params.get("mscale") and params.get("mscale_all_dim"):
        return float(_yarn_mscale(factor, params["mscale"]) / _yarn_mscale(factor, params["mscale_all_dim"]))
    return float(_yarn_mscale(factor))


def _llama3(inv_freq: torch.Tensor, factor: float, low: float, high: float, original: int) -> torch.Tensor:
    low_wavelen, high_wavelen = original / low, original / high
    wave_len = 2 * math.pi / inv_freq
    smooth = (original / wave_len - low) / (high - low) if low != high else 0
    return torch.where(wave_len < high_wavelen, inv_freq,
                       torch.where(wave_len > low_wavelen, inv_freq / factor,
                                   (1 - smooth) * inv_freq / factor + smooth * inv_freq))


def _yarn(base: float, dim: int, params: dict) -> torch.Tensor:
    factor, original = params["factor"], params["original_max_position_embeddings"]
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.float) / dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(params.get("beta_fast", 32)), correction_dim(params.get("beta_slow", 1))
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # as vLLM: no singular ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float) - low) / (high - low), 0, 1)
    mask = 1 - ramp
    return interpolation * (1 - mask) + extrapolation * mask


def _yarn_mscale(scale: float, mscale: float = 1) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0
