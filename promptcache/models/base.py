"""The adapter contract: how position IDs (and custom masks) reach attention for one family.

An adapter wraps a stock ``transformers`` causal LM instance; it never copies model code.
Three ways positions reach attention (DESIGN.md section 5), one subclass each in ``kinds.py``:

* rotary and learned absolute positions: the model takes ``position_ids``;
* ALiBi: the bias is built inside the model from key *indices*; the adapter installs forward
  pre-hooks on the model's blocks (per instance) that replace that one tensor with one built
  from our key positions. The hooks read a per-thread state set only inside
  ``Adapter.forward``; outside it the model behaves exactly as stock.

``forward`` runs new tokens on a ``SpliceCache``: appended after the filled slots (the hot path),
or written at named slots under a caller's attention mask (``write_slots``, ``attention_mask``),
which is how tokens in the middle of an assembled cache are recomputed. Every adapter checks
itself once per model instance (``self_check``, called by ``get_adapter``) and is refused if its
forward does not equal the stock forward at contiguous positions.

Decisions: ``max_positions`` is a property (the model's context length, or None); the
attention implementation is read from ``config._attn_implementation``, the attribute transformers
itself documents for it (there is no public getter in transformers 5).
"""

from __future__ import annotations

import logging
import threading
from contextlib import contextmanager, nullcontext
from typing import ClassVar

import torch
import transformers

from .splice import KVSpec, SpliceCache
from ..errors import PromptCacheError
from ..kernels import ordered_attention
from .masks import BOOL_MASK_ATTENTION, additive as additive_mask, check as check_mask, slot_causal

log = logging.getLogger(__name__)

__all__ = ["Adapter", "KVSpec", "UnsupportedModelError"]


def attention_kernels(device: torch.device):
    """The SDPA kernels a spliced forward may use: on CUDA every backend but cuDNN's, which builds
    an execution plan for each new (query, key) shape and stride, paid on the first forward of
    every new prompt length, where flash / memory-efficient attention pay nothing. The price: long
    uncached chunks run slower (figures: docs/gpu.md). Elsewhere no restriction."""
    if device.type != "cuda":
        return nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH])


# transformers' per-config attention implementation (a property of its configs; ``attention_as``)
ATTN_FIELD = "_attn_implementation"


class UnsupportedModelError(PromptCacheError, ValueError):
    """The architecture (or one of its settings) has not been verified for exact splicing."""

    exit_code = 1


class Adapter:
    """Base adapter. Subclasses set ``model_types`` and ``positional`` and may override the hooks.

    ``relocation`` declares how stored states move to new positions (``relocate.py`` dispatches on
    it): ``"rotate_keys"`` (rotary), ``"positions_only"`` (ALiBi: tensors unchanged) or None, in
    which case ``relocation_refusal`` says why not.
    """

    model_types: ClassVar[tuple[str, ...]] = ()
    positional: ClassVar[str] = "rotary"  # "rotary" | "alibi" | "learned"
    passes_position_ids: ClassVar[bool] = True
    # the model computes attention inline, not through transformers' attention interface: paged
    # forwards reach it through ``paged_attention`` (ALiBi families)
    inline_attention: ClassVar[bool] = False
    # sliding windows applied by position ID in every forward on a ``SpliceCache`` too (each layer
    # type its own mask, ``layer_mask_kwargs``), not by cache index: a gapped or longer-than-the-window
    # sequence is then exact there as on the pool (Gemma 3)
    windows_by_position: ClassVar[bool] = False
    relocation: ClassVar[str | None] = None
    relocation_refusal: ClassVar[str] = "this model's stored states cannot be moved to new positions exactly"

    def __init__(self, model):
        self.model = model
        self.config = model.config
        self._ctx = threading.local()
        self._one_config: bool | None = None  # attention_as: every submodel reads self.config
        self.check_config()

    @classmethod
    def context_of(cls, config) -> int | None:
        """``max_positions`` for a config alone, no model (validate and inspect load no weights):
        the property reads nothing but ``self.config``."""
        probe = cls.__new__(cls)
        probe.config = config
        return probe.max_positions

    @classmethod
    def select(cls, config) -> type["Adapter"]:
        """The concrete adapter class for this config (a family may have variants)."""
        return cls

    def close(self) -> None:
        """Undo what the adapter installed on the model (nothing for most families)."""

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

    @property
    def max_positions(self) -> int | None:
        """The model's context length in positions (None: the config names none)."""
        return getattr(self.config, "max_position_embeddings", None)

    def max_position(self) -> int | None:
        """Largest position ID the model can take exactly (None: unbounded)."""
        return None

    def max_entries(self) -> int | None:
        """Most key/value entries one forward may attend to exactly (None: unbounded)."""
        return None

    @property
    def context_limit(self) -> int | None:
        """Most tokens one sequence (prompt plus answer) may hold and be served exactly: the
        context (``max_positions``, which knows bounded ropes and MPT's ``max_seq_len``). None:
        unbounded. The server's request limit reads it, not ``max_position_embeddings``. A sliding
        window does not bound it: the KV pool applies windows by position ID (``paged.KeyRule``),
        so a sequence longer than the window is served exactly; only a prompt assembled in a
        private buffer (selective recompute), whose mask counts entries, must fit in the window
        (``check_limits`` refuses it, naming the window), except in families that apply windows
        by position there too (``windows_by_position``)."""
        return self.max_positions

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

    def can_relocate(self) -> bool:
        """Whether stored states can be moved to new positions exactly (``relocate.py``)."""
        try:
            self.check_relocatable()
        except UnsupportedModelError:
            return False
        return True

    def check_relocatable(self) -> None:
        """Raise ``UnsupportedModelError`` saying why this model's states cannot be relocated."""
        if self.relocation is None:
            raise UnsupportedModelError(self.relocation_refusal)

    def sliding_windows(self) -> list[int | None] | None:
        """Each layer's sliding attention window in positions (None: no window anywhere)."""
        return None

    # -- paged forwards of inline attention ------------------------------------------------------
    @contextmanager
    def paged_attention(self, attend):
        """For the forwards inside: every attention module of this model instance runs
        ``attend(module, query, key, value, cache, scaling) -> [1, t, Hq, D]`` instead of its own
        attention: an instance ``forward`` (the class and every forward outside untouched) computes
        queries, keys and values with the module's own weights (``paged_qkv``) and finishes as the
        module does (``paged_output``). For families with ``inline_attention`` (no attention
        interface in transformers); one forward at a time (the runner's lock)."""
        if not self.inline_attention:
            raise NotImplementedError(f"{type(self).__name__} uses transformers' attention interface")
        modules = self.attention_modules()

        def forward_of(module):
            def forward(hidden_states, *args, **kwargs):
                if args:  # Bloom passes the residual positionally
                    kwargs["residual"] = args[0]
                q, k, v, cache, scaling = self.paged_qkv(module, hidden_states, kwargs)
                out = attend(module, q, k, v, cache, scaling)  # [1, t, H, D]
                return self.paged_output(module, out.reshape(*out.shape[:2], -1), hidden_states, kwargs)
            return forward

        for m in modules:
            m.forward = forward_of(m)  # an instance attribute: shadows the class's forward
        try:
            yield
        finally:
            for m in modules:
                del m.forward

    def attention_modules(self) -> list[torch.nn.Module]:
        """The model's attention modules, in layer order (``inline_attention`` families)."""
        raise NotImplementedError

    def paged_qkv(self, module, hidden_states: torch.Tensor, kwargs: dict):
        """(query [1, H, t, D], key, value [1, Hk, t, D], the call's cache argument, scaling) of
        one attention module call, computed with the module's weights."""
        raise NotImplementedError

    def paged_output(self, module, context: torch.Tensor, hidden_states: torch.Tensor, kwargs: dict):
        """The module's return value from the attention output ``context`` [1, t, H * D]."""
        raise NotImplementedError

    # -- forward -------------------------------------------------------------------------------
    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, cache: SpliceCache, *,
                write_slots: torch.Tensor | None = None, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Run new tokens on top of ``cache`` (whose ``positions`` hold every entry's position ID).

        input_ids, position_ids: [B, T]. Returns last-token logits [B, V].
        ``write_slots`` (LongTensor [T] or [B, T]): write the new states (and positions) at these
        slots instead of appending; see ``SpliceCache.slot_write`` for the rules. The default mask
        is then: every filled slot not being rewritten, plus the new tokens causally in their order.
        ``attention_mask`` (BoolTensor [B or 1, 1, T, kv_len], True = attend, kv_len = the length
        after this forward) replaces the default mask (all cached entries + causal over the new
        tokens).
        """
        with attention_kernels(input_ids.device):
            if write_slots is None and attention_mask is None and self.windows_by_position:
                # every cached entry plus the new tokens causally, windows applied by position below
                old = cache.length
                attention_mask = torch.ones((1, 1, input_ids.shape[1], old + input_ids.shape[1]), dtype=torch.bool,
                                            device=cache.buf.device)
                attention_mask[..., old:] = torch.ones_like(attention_mask[0, 0, :, old:]).tril()
            if write_slots is None and attention_mask is None:  # the hot path
                cache.stage_positions(position_ids)
                kwargs = {"position_ids": position_ids} if self.passes_position_ids else {}
                with self._positions(cache.key_positions(position_ids.shape[1])) as state:
                    out = self.model(input_ids=input_ids, past_key_values=cache, use_cache=True, logits_to_keep=1,
                                     **kwargs)
                self.verify_forward(state)
                return out.logits[:, -1, :]
            return self._forward_masked(input_ids, position_ids, cache, write_slots, attention_mask)

    def _forward_masked(self, input_ids, position_ids, cache, write_slots, attention_mask) -> torch.Tensor:
        b, t = input_ids.shape
        self.check_mask_support()  # before the cache is touched
        kwargs = {"position_ids": position_ids} if self.passes_position_ids else {}
        old = cache.length
        if write_slots is None:
            mask = check_mask(attention_mask, b, t, old + t).to(cache.buf.device)
            cache.stage_positions(position_ids)
            kwargs.update(self.layer_mask_kwargs(mask, cache.positions[:, : old + t], position_ids))
            with self._positions(cache.positions[:, : old + t], mask) as state, self.masked_attention(cache):
                out = self.model(input_ids=input_ids, past_key_values=cache, use_cache=True, logits_to_keep=1,
                                 **kwargs)
        else:
            if attention_mask is not None and isinstance(write_slots, torch.Tensor) and write_slots.numel():
                top = max(old, int(write_slots.max()) + 1)  # the length after the write, checked again below
                attention_mask = check_mask(attention_mask, b, t, top).to(cache.buf.device)
            with cache.slot_write(position_ids, write_slots) as kv_len:
                if attention_mask is None:
                    mask = slot_causal(old, cache.pending[0], kv_len)
                else:
                    mask = attention_mask
                kwargs.update(self.layer_mask_kwargs(mask, cache.positions[:, :kv_len], position_ids))
                with self._positions(cache.positions[:, :kv_len], mask) as state, self.masked_attention(cache):
                    out = self.model(input_ids=input_ids, past_key_values=cache, use_cache=True, logits_to_keep=1,
                                     **kwargs)
        self.verify_forward(state)
        return out.logits[:, -1, :]

    def check_mask_support(self) -> None:
        """Raise ``UnsupportedModelError`` if custom masks cannot reach this model's attention."""
        impl = self.attn_implementation()
        if impl != "eager" and impl not in BOOL_MASK_ATTENTION:
            raise UnsupportedModelError(
                f"custom attention masks (write_slots / attention_mask) need attn_implementation 'sdpa' or "
                f"'eager'; this {self.config.model_type} model uses '{impl}' (load it with attn_implementation='sdpa')"
            )

    def masked_attention(self, cache: SpliceCache):
        """The attention a masked forward over ``cache`` runs in (a context): where the model's is
        "sdpa" and the cache is on the CPU, ``kernels/ordered_attention.py`` (a mask that gives each
        query a prefix of the keys takes the native kernel, which reads only that prefix; any other
        mask runs transformers' sdpa function as before); else the model's own."""
        if not self.inline_attention and self.attn_implementation() == "sdpa" \
                and ordered_attention.covers(cache.buf.device):
            return self.attention_as(ordered_attention.NAME)
        return nullcontext()

    def mask_kwargs(self, mask: torch.Tensor) -> dict:
        """Model keyword arguments that carry ``mask`` (bool [B|1, 1, T, kv], True = attend) to
        attention: a 4D mask, which transformers' ``create_causal_mask`` passes through as is, bool
        for sdpa and additive float for eager. ALiBi adapters override (their hooks carry it)."""
        self.check_mask_support()
        if self.attn_implementation() in BOOL_MASK_ATTENTION:
            return {"attention_mask": mask}
        return {"attention_mask": additive_mask(mask, self.kv_spec().dtype)}

    def layer_mask_kwargs(self, mask: torch.Tensor, key_positions: torch.Tensor, position_ids: torch.Tensor) -> dict:
        """``mask_kwargs`` for a forward whose keys sit at ``key_positions`` [B, kv] and queries at
        ``position_ids`` [B, T]: families with ``windows_by_position`` add each layer type's window
        (measured in position IDs) to the mask; the others carry ``mask`` as it is."""
        return self.mask_kwargs(mask)

    def attn_implementation(self) -> str:
        return getattr(self.config, ATTN_FIELD, None) or "eager"

    @contextmanager
    def attention_as(self, name: str):
        """The model's attention is ``name`` (a name in transformers' ``AttentionInterface``) inside
        the block, then what it was. transformers' setter, ``set_attn_implementation``, walks every
        module on each call (~1.5 ms for SmolLM2: twice a paged step); where every submodel reads
        the model's one config and it has no sub-configs, the setter changes nothing but that
        config's attention field, so the field is written instead (worked out once a model)."""
        old = self.attn_implementation()
        if self._one_config is None:
            self._one_config = not self.config.sub_configs and all(
                m.config is self.config for m in self.model.modules() if isinstance(m, transformers.PreTrainedModel))
        set_to = (lambda n: setattr(self.config, ATTN_FIELD, n)) if self._one_config else self.model.set_attn_implementation
        set_to(name)
        try:
            yield
        finally:
            set_to(old)

    def verify_forward(self, state: dict) -> None:
        """Called after every forward with the per-forward state (ALiBi: did every hook run?)."""

    @contextmanager
    def _positions(self, key_positions: torch.Tensor, mask: torch.Tensor | None = None):
        """Make key positions [B, kv_len] (and a custom mask) visible to the hooks for one forward."""
        prev = getattr(self._ctx, "state", None)
        state = self._ctx.state = {"key_positions": key_positions, "mask": mask, "calls": 0}
        try:
            yield state
        finally:
            self._ctx.state = prev

    def _state(self) -> dict | None:
        return getattr(self._ctx, "state", None)

    # -- self-check ----------------------------------------------------------------------------
    @torch.inference_mode()
    def self_check(self, n_tokens: int = 6) -> None:
        """Compare this adapter's forward with the stock forward at contiguous positions 0..n-1,
        once through the hot path and once recomputing every slot through ``write_slots`` with a
        causal mask (skipped, with a log line, where the attention implementation takes no custom
        mask; such forwards then raise). Raises ``UnsupportedModelError`` on a mismatch.
        Runs with the model in eval mode (dropout off) and restores its mode afterwards."""
        was_training = self.model.training
        self.model.eval()
        try:
            self._self_check(n_tokens)
        finally:
            self.model.train(was_training)

    def _self_check(self, n: int) -> None:
        n = max(3, min(n, self.max_entries() or n))  # inside a sliding window, where a causal mask is exact
        device = next(self.model.parameters()).device
        vocab = self.model.get_input_embeddings().num_embeddings
        ids = ((torch.arange(n, device=device) * 7 + 5) % vocab)[None]  # [1, n]
        pos = torch.arange(n, device=device)[None]
        stock = self.model(input_ids=ids, use_cache=False).logits[:, -1].float()
        spec = self.kv_spec()
        tol = max(1e-4, 16 * torch.finfo(spec.dtype).eps) * max(1.0, stock.abs().max().item())
        cache = SpliceCache(spec, n, device=device)
        self._compare(stock, self.forward(ids, pos, cache), tol, "the hooked forward")
        try:
            self.check_mask_support()
        except UnsupportedModelError as e:
            log.info("self-check of the slot/mask path skipped: %s", e)
            return
        cache = SpliceCache(spec, n, device=device)
        self.forward(ids[:, : n - 2], pos[:, : n - 2], cache)
        slots = torch.arange(n, device=device)
        got = self.forward(ids, pos, cache, write_slots=slots, attention_mask=slot_causal(n - 2, slots, n))
        self._compare(stock, got, tol, "a forward through write_slots and a causal attention_mask")

    def _compare(self, stock: torch.Tensor, got: torch.Tensor, tol: float, what: str) -> None:
        diff = (got.float() - stock).abs().max().item()
        if not diff <= tol:  # also catches NaN
            raise UnsupportedModelError(
                f"self-check failed for this {self.config.model_type} model ({type(self).__name__}, "
                f"transformers {transformers.__version__}): {what} at contiguous positions differs from the "
                f"stock forward by {diff:.3g} (tolerance {tol:.3g}); refusing the model rather than giving "
                "inexact answers"
            )
