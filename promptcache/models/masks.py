"""Attention masks for slot-addressed forwards. Convention everywhere here: bool, True = attend,
shape ``[B or 1, 1, T, kv_len]`` (query ``i`` of the ``T`` new tokens, key slot ``j``)."""

from __future__ import annotations

import torch

# attention implementations (transformers' names) that take a bool mask, True = attend, as sdpa
# does; an attention registered elsewhere that does adds its name (engine/prefill/question_pass.py)
BOOL_MASK_ATTENTION: set[str] = {"sdpa"}


def slot_causal(old_len: int, slots: torch.Tensor, kv_len: int) -> torch.Tensor:
    """The default mask of a slot write: query ``i`` sees every slot in [0, old_len) that this
    forward does not rewrite, and the new tokens 0..i at their slots (causal in input order).

    slots: LongTensor [T] or [B, T]. Returns bool [1 or B, 1, T, kv_len] on slots' device."""
    rows = slots if slots.dim() == 2 else slots[None]  # [R, T]
    r, t = rows.shape
    mask = torch.zeros((r, t, kv_len), dtype=torch.bool, device=slots.device)
    mask[:, :, :old_len] = True
    causal = torch.ones((t, t), dtype=torch.bool, device=slots.device).tril()  # [query i, new token j]
    for row in range(r):
        mask[row][:, rows[row]] = causal  # column slots[j] visible to queries i >= j, hidden before
    return mask[:, None]


def check(mask: torch.Tensor, batch: int, t: int, kv_len: int) -> torch.Tensor:
    """Validate a caller's mask: bool [batch or 1, 1, t, kv_len], every query seeing some key."""
    if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool:
        raise ValueError(f"attention_mask must be a BoolTensor (True = attend), got "
                         f"{type(mask).__name__} {getattr(mask, 'dtype', '')}")
    if mask.dim() != 4 or mask.shape[0] not in (1, batch) or tuple(mask.shape[1:]) != (1, t, kv_len):
        raise ValueError(f"attention_mask must be [B, 1, T, kv_len] = [{batch}, 1, {t}, {kv_len}] "
                         f"(kv_len: the cache length after this forward), got {list(mask.shape)}")
    if not bool(mask.any(dim=-1).all()):
        raise ValueError("attention_mask has a query that attends to nothing")
    return mask


def additive(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Bool mask -> additive float mask in ``dtype``: 0 where attended, the dtype's minimum elsewhere
    (what transformers' eager attention adds to its scores)."""
    out = torch.zeros(mask.shape, dtype=dtype, device=mask.device)
    return out.masked_fill_(~mask, torch.finfo(dtype).min)
