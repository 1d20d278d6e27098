"""Position-independent modules: move stored key/value states to new positions, exactly.

A stored span is ``kv [L, 2, H, n, D]`` (0 = keys, 1 = values) encoded at positions
``p .. p + n - 1``. ``relocate(adapter, kv, d)`` returns the states the model would have cached
had the same entries sat at ``p + d .. p + d + n - 1`` (same tokens, same attention context).
Values never carry a position; what keys carry depends on how positions reach attention:

* rotary: ``transformers`` caches keys *after* the rotary embedding,
  ``k_p = s * (k * cos(p f) + rotate_half(k) * sin(p f))`` over the first ``rotary_dim``
  channels (the rest pass through; ``s`` is the rope type's ``attention_scaling``). Rotations
  compose, so ``k_{p+d} = k_p * cos(d f) + rotate_half(k_p) * sin(d f)``, with no second ``s``.
  ``f`` (``inv_freq``) is read from the model's own rotary module, so scaled ropes (linear,
  llama3, yarn, ...) use exactly the frequencies the model uses;
* ALiBi: the bias is built from key positions at attention time (see ``AlibiAdapter``), so the
  tensors are unchanged and only the position IDs the caller stores with them move;
* learned absolute positions (GPT-2, OPT): the position embedding is added to the input of the
  first layer and mixed into every later key and value; no tensor operation undoes it. Refused.
* Falcon with ALiBi is refused too: it multiplies slopes by absolute positions in bfloat16 (even
  in float32 models), so its states depend on absolute positions through rounding (with
  power-of-two slopes, odd positions past 256 round to even ones) and moving them is not exact.
  Bloom and MPT build the bias in float32 and are exact at float32; in half precision Bloom's
  bias, like any half-precision state, carries rounding that depends on absolute position.

Dispatch is a registry keyed by the capability the adapter declares (``Adapter.relocation``:
``"rotate_keys"``, ``"positions_only"``, or None with ``Adapter.relocation_refusal`` saying why);
an unknown kind is refused. This module builds on ``base``/``kinds``; they never import it. Rotary relocation assumes the
``rotate_half`` convention that every registered rotary family uses (Llama, Mistral, Qwen2/3,
Phi-3, GPT-NeoX, Falcon); an interleaved-pair family would need its own mover.

Rope types whose frequencies change per forward (``dynamic``, ``longrope``) depend only on the
largest position of that forward. Below ``original_max_position_embeddings`` both use their
original frequencies, and ``Adapter.check_limits`` already refuses every prompt past that (the
same bound that makes plain encoding exact for them), so relocation uses ``original_inv_freq``
and is exact for every position the engine accepts.
"""

from __future__ import annotations

import numbers
import weakref
from typing import Callable

import torch

from .base import Adapter, UnsupportedModelError
from .kinds import RopeSpec, RotaryAdapter

__all__ = ["RopeSpec", "can_relocate", "check_relocatable", "mover", "relocate", "rope_spec", "rotate_keys"]

Mover = Callable[[torch.Tensor, int], torch.Tensor]  # (kv [L, 2, H, n, D], delta) -> new kv


# -- public API ------------------------------------------------------------------------------------
def relocate(adapter: Adapter, kv: torch.Tensor, delta: int) -> torch.Tensor:
    """States of a stored span moved by ``delta`` positions (may be negative): a new tensor.

    kv: [L, 2, H, n, D] as stored (``SpliceCache.read``, ``EncodedSchema.kv``), any device and
    dtype; the result has kv's shape, dtype and device, and ``kv`` is left untouched. The caller
    shifts the span's position IDs by the same ``delta``. Raises ``UnsupportedModelError`` for
    architectures whose states cannot be moved exactly, ``ValueError`` for a malformed ``kv``."""
    if not isinstance(delta, numbers.Integral) or isinstance(delta, bool):
        raise ValueError(f"delta must be an integer number of positions, got {delta!r}")
    _check_shape(adapter, kv)
    return mover(adapter)(kv, int(delta))


def can_relocate(adapter: Adapter) -> bool:
    """Whether ``relocate`` works for this model (``check_relocatable`` says why not)."""
    return adapter.can_relocate()


def check_relocatable(adapter: Adapter) -> None:
    """Raise ``UnsupportedModelError`` explaining why this model's states cannot be relocated."""
    mover(adapter)


def mover(adapter: Adapter) -> Mover:
    """The relocation function for one adapter (built once per adapter instance)."""
    cached = _MOVER_CACHE.get(adapter)
    if cached is None:
        adapter.check_relocatable()  # raises UnsupportedModelError with the adapter's reason
        factory = _MOVERS.get(adapter.relocation)
        if factory is None:
            raise UnsupportedModelError(
                f"cannot relocate states of relocation kind '{adapter.relocation}' "
                f"(relocatable kinds: {', '.join(sorted(_MOVERS))})"
            )
        cached = _MOVER_CACHE[adapter] = factory(adapter)
    return cached


def rotate_keys(kv: torch.Tensor, inv_freq: torch.Tensor, delta: int) -> torch.Tensor:
    """kv [L, 2, H, n, D] with keys rotated by ``delta`` positions over the first
    ``2 * inv_freq.shape[-1]`` channels. ``inv_freq``: [r / 2] for every layer, or [L, r / 2], a
    row per layer (layers with their own rope base). The angle is computed in float64 (exact for
    large deltas), the rotation in at least float32, and the result rounded once to kv's dtype."""
    r = 2 * inv_freq.shape[-1]
    if r > kv.shape[-1]:
        raise ValueError(f"rotary dim {r} exceeds head_dim {kv.shape[-1]}")
    if inv_freq.dim() == 2 and inv_freq.shape[0] != kv.shape[0]:
        raise ValueError(f"per-layer frequencies for {inv_freq.shape[0]} layers, states of {kv.shape[0]}")
    angle = delta * inv_freq.to(torch.float64)  # [r / 2] or [L, r / 2]
    compute = torch.promote_types(kv.dtype, torch.float32)
    cos = torch.cat([angle.cos(), angle.cos()], dim=-1).to(device=kv.device, dtype=compute)  # [r] or [L, r]
    sin = torch.cat([angle.sin(), angle.sin()], dim=-1).to(device=kv.device, dtype=compute)
    if inv_freq.dim() == 2:  # [L, 1, 1, r]: broadcast over heads and tokens of each layer
        cos, sin = cos[:, None, None], sin[:, None, None]
    out = kv.clone()
    k = kv[:, 0, ..., :r].to(compute)  # [L, H, n, r]
    out[:, 0, ..., :r] = (k * cos + _rotate_half(k) * sin).to(kv.dtype)
    return out


def rope_spec(adapter: Adapter) -> RopeSpec:
    """The model's rotary frequencies (``RotaryAdapter.rope_spec``); refuses rope settings under
    which rotating stored keys is not exact, and non-rotary models."""
    if not isinstance(adapter, RotaryAdapter):
        raise UnsupportedModelError(f"{adapter.config.model_type} has no rotary embedding")
    cached = _ROPE_CACHE.get(adapter)
    if cached is None:  # read once an adapter: finding the rotary module walks the model's modules
        # (~0.5 ms, and every serving step that reads a document shifted asks); the verified rope
        # types' frequencies are fixed
        cached = _ROPE_CACHE[adapter] = adapter.rope_spec()
    return cached


# -- movers: registry keyed by Adapter.relocation ---------------------------------------------------
_MOVERS: dict[str, Callable[[Adapter], Mover]] = {}
_MOVER_CACHE: "weakref.WeakKeyDictionary[Adapter, Mover]" = weakref.WeakKeyDictionary()
_ROPE_CACHE: "weakref.WeakKeyDictionary[Adapter, RopeSpec]" = weakref.WeakKeyDictionary()


def _register(kind: str):
    def deco(factory: Callable[[Adapter], Mover]):
        _MOVERS[kind] = factory
        return factory

    return deco


@_register("rotate_keys")
def _rotary_mover(adapter: Adapter) -> Mover:
    spec = rope_spec(adapter)
    return lambda kv, delta: rotate_keys(kv, spec.inv_freq, delta)


@_register("positions_only")
def _alibi_mover(adapter: Adapter) -> Mover:
    return lambda kv, delta: kv.clone()  # keys carry no position; only the position IDs move


# -- helpers -----------------------------------------------------------------------------------------
def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    """transformers' rotate_half: [x1, x2] -> [-x2, x1] over the last dim."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def _check_shape(adapter: Adapter, kv: torch.Tensor) -> None:
    spec = adapter.kv_spec()
    want = (spec.layers, 2, spec.kv_heads, spec.head_dim)
    got = tuple(kv.shape[:3]) + tuple(kv.shape[4:]) if kv.dim() == 5 else None
    if got != want:
        raise ValueError(
            f"kv must be [layers, 2, kv_heads, n, head_dim] = [{want[0]}, 2, {want[2]}, n, {want[3]}] "
            f"for this model, got {list(kv.shape)}"
        )
