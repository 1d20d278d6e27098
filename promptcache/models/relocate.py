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

Dispatch is a registry keyed by adapter class (most specific first), then by
``Adapter.positional``; an unknown kind is refused. Rotary relocation assumes the
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
from dataclasses import dataclass
from typing import Callable

import torch

from .base import Adapter, UnsupportedModelError
from .families import FalconAlibi

Mover = Callable[[torch.Tensor, int], torch.Tensor]  # (kv [L, 2, H, n, D], delta) -> new kv

_STATIC_ROPES = ("default", "linear", "llama3", "yarn")  # inv_freq fixed at init
_BOUNDED_ROPES = ("dynamic", "longrope")  # original inv_freq below the adapter's max_position


@dataclass(frozen=True)
class RopeSpec:
    """The rotary frequencies one model applies to its keys."""

    inv_freq: torch.Tensor  # [rotary_dim // 2], float64 on CPU: the model's own float32 values
    rope_type: str

    @property
    def rotary_dim(self) -> int:
        """Leading channels of each head that are rotated; ``head_dim - rotary_dim`` pass through."""
        return 2 * self.inv_freq.numel()


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
    try:
        check_relocatable(adapter)
    except UnsupportedModelError:
        return False
    return True


def check_relocatable(adapter: Adapter) -> None:
    """Raise ``UnsupportedModelError`` explaining why this model's states cannot be relocated."""
    mover(adapter)


def mover(adapter: Adapter) -> Mover:
    """The relocation function for one adapter (built once per adapter instance)."""
    cached = _MOVER_CACHE.get(adapter)
    if cached is None:
        keys = (*type(adapter).__mro__, adapter.positional)
        factory = next((_MOVERS[k] for k in keys if k in _MOVERS), None)
        if factory is None:
            raise UnsupportedModelError(
                f"cannot relocate states of positional kind '{adapter.positional}' "
                f"(relocatable kinds: {', '.join(sorted(_MOVERS))})"
            )
        cached = _MOVER_CACHE[adapter] = factory(adapter)  # may raise UnsupportedModelError
    return cached


def rotate_keys(kv: torch.Tensor, inv_freq: torch.Tensor, delta: int) -> torch.Tensor:
    """kv [L, 2, H, n, D] with keys rotated by ``delta`` positions over the first
    ``2 * len(inv_freq)`` channels. The angle is computed in float64 (exact for large deltas),
    the rotation in at least float32, and the result rounded once to kv's dtype."""
    r = 2 * inv_freq.numel()
    if r > kv.shape[-1]:
        raise ValueError(f"rotary dim {r} exceeds head_dim {kv.shape[-1]}")
    angle = delta * inv_freq.to(torch.float64)  # [r / 2]
    compute = torch.promote_types(kv.dtype, torch.float32)
    cos = torch.cat([angle.cos(), angle.cos()]).to(device=kv.device, dtype=compute)  # [r]
    sin = torch.cat([angle.sin(), angle.sin()]).to(device=kv.device, dtype=compute)
    out = kv.clone()
    k = kv[:, 0, ..., :r].to(compute)  # [L, H, n, r]
    out[:, 0, ..., :r] = (k * cos + _rotate_half(k) * sin).to(kv.dtype)
    return out


def rope_spec(adapter: Adapter) -> RopeSpec:
    """The model's rotary frequencies, read from its own rotary module; refuses rope settings
    under which rotating stored keys is not exact."""
    rotary = _rotary_module(adapter.model)
    rope_type = getattr(rotary, "rope_type", "default")
    if not isinstance(rope_type, str):  # per-layer-type ropes (a dict): not a registered family
        raise UnsupportedModelError(f"cannot relocate: per-layer rope types {rope_type!r} are not verified")
    if rope_type in _STATIC_ROPES:
        inv_freq = rotary.inv_freq
    elif rope_type in _BOUNDED_ROPES:
        if adapter.max_position() is None:  # the bound below which original frequencies hold
            raise UnsupportedModelError(f"cannot relocate: rope type '{rope_type}' without a position limit")
        inv_freq = rotary.original_inv_freq
    else:
        raise UnsupportedModelError(
            f"cannot relocate: rope type '{rope_type}' is not verified "
            f"(verified: {', '.join(_STATIC_ROPES + _BOUNDED_ROPES)})"
        )
    return RopeSpec(inv_freq.detach().to("cpu", torch.float64), rope_type)


# -- movers: registry keyed by adapter class or by Adapter.positional -------------------------------
_MOVERS: dict[str | type[Adapter], Callable[[Adapter], Mover]] = {}
_MOVER_CACHE: "weakref.WeakKeyDictionary[Adapter, Mover]" = weakref.WeakKeyDictionary()


def _register(key: str | type[Adapter]):
    def deco(factory: Callable[[Adapter], Mover]):
        _MOVERS[key] = factory
        return factory

    return deco


@_register("rotary")
def _rotary_mover(adapter: Adapter) -> Mover:
    spec = rope_spec(adapter)
    if spec.rotary_dim > adapter.head_dim():
        raise UnsupportedModelError(f"rotary dim {spec.rotary_dim} exceeds head_dim {adapter.head_dim()}")
    return lambda kv, delta: rotate_keys(kv, spec.inv_freq, delta)


@_register("alibi")
def _alibi_mover(adapter: Adapter) -> Mover:
    return lambda kv, delta: kv.clone()  # keys carry no position; only the position IDs move


@_register(FalconAlibi)
def _falcon_alibi_mover(adapter: Adapter) -> Mover:
    raise UnsupportedModelError(
        "cannot relocate states of a Falcon ALiBi model: Falcon computes its ALiBi bias as bfloat16 "
        "slope * absolute position (8 significant bits, even in float32 models), so its states depend "
        "on absolute positions through rounding and moving them is not exact; re-encode the span at "
        "its new positions instead"
    )


@_register("learned")
def _learned_mover(adapter: Adapter) -> Mover:
    raise UnsupportedModelError(
        f"cannot relocate states of this {adapter.config.model_type} model: it uses learned absolute "
        "position embeddings, added to the token embeddings before the first layer, so every key and "
        "value mixes in its position nonlinearly and there is no exact way to move them; "
        "re-encode the span at its new positions instead"
    )


# -- helpers -----------------------------------------------------------------------------------------
def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    """transformers' rotate_half: [x1, x2] -> [-x2, x1] over the last dim."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def _rotary_module(model) -> torch.nn.Module:
    found = [m for m in model.modules() if type(m).__name__.endswith("RotaryEmbedding")]
    if len(found) != 1:
        raise UnsupportedModelError(
            f"cannot relocate: expected one rotary embedding module in this {model.config.model_type} "
            f"model, found {len(found)}"
        )
    return found[0]


def _check_shape(adapter: Adapter, kv: torch.Tensor) -> None:
    spec = adapter.kv_spec()
    want = (spec.layers, 2, spec.kv_heads, spec.head_dim)
    got = tuple(kv.shape[:3]) + tuple(kv.shape[4:]) if kv.dim() == 5 else None
    if got != want:
        raise ValueError(
            f"kv must be [layers, 2, kv_heads, n, head_dim] = [{want[0]}, 2, {want[2]}, n, {want[3]}] "
            f"for this model, got {list(kv.shape)}"
        )
