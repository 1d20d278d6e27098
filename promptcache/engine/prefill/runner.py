"""``ModelRunner``: the model and everything needed to run it (adapter, KV spec, device, forward
lock, buffer pool, EOS ids): ``forward``, a plan assembled in a private buffer and the plain prefill.

Decisions:
  * Every forward of an engine goes through ``forward`` / ``prefill_plain`` (and the serving
    core's paged forward) under ``lock`` (one at a time per engine; ALiBi position context is
    thread-local), so several threads may share one engine.
  * A prefill that keeps its cache hands the buffer to the caller until ``release``; on any error
    the buffer goes back to the pool before the error propagates.
  * ``kv_dtype``: the dtype module states are stored in (``stored_spec``); the model computes in
    its own dtype (``spec``). Stored spans are converted while they are copied into the splice
    buffer (one ``copy_``, no extra copy), so storing bfloat16 halves stored bytes at no copy.
"""

from __future__ import annotations

import threading
import time

import torch

from ...models.splice import CachePool, KVSpec, SpliceCache
from ...layout import PromptLayout
from ...models import get_adapter
from .plan import PrefillPlan, Segment
from .ordered import ordered_plan
from .recompute import KEY_SCALES, SCORED, RecomputeRequest, choose, question_scores, run_recompute, scaled_slots
from .results import PrefillResult

__all__ = ["ModelRunner", "eos_ids"]

def eos_ids(model, tokenizer) -> frozenset[int]:
    """Token ids that end generation: the model's generation config, else the tokenizer's EOS."""
    ids = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if ids is None:
        ids = tokenizer.eos_token_id
    if ids is None:
        return frozenset()
    return frozenset([ids] if isinstance(ids, int) else ids)


class ModelRunner:
    def __init__(self, model, tokenizer, device: torch.device | None = None, kv_dtype: str | None = None,
                 overlap_copies: bool = False):
        self.model = model.eval()
        self.adapter = get_adapter(model)
        self.spec = self.adapter.kv_spec()  # what the model computes in (the splice buffer)
        stored = getattr(torch, kv_dtype) if kv_dtype else self.spec.dtype
        self.stored_spec = KVSpec(self.spec.layers, self.spec.kv_heads, self.spec.head_dim, stored)  # the store
        self.device = device or next(model.parameters()).device
        self.lock = threading.RLock()  # one forward at a time per engine
        self.pool = CachePool(self.spec, self.device, overlap=overlap_copies)
        self.eos_ids = eos_ids(model, tokenizer)

    # -- forwards ---------------------------------------------------------------------------------
    def forward(self, ids: torch.Tensor, pos: torch.Tensor, cache: SpliceCache) -> torch.Tensor:
        """New tokens ids/pos [B, T] on top of ``cache``; last-token logits [B, V]."""
        with self.lock:
            return self.adapter.forward(ids, pos, cache)

    def prefill_spliced(self, plan: PrefillPlan, t0: float | None = None, reserve: int = 0,
                        keep_cache: bool = False, recompute: RecomputeRequest | None = None) -> PrefillResult:
        """The plan assembled in a private buffer: its segments placed at slots 0.. in order (copying
        only those not already in place), its new tokens run on top; ``reserve``: slots kept free
        for generated tokens. ``recompute``: also compute a selection of the cached tokens afresh
        (``recompute.py``); with every candidate recomputed and the layout's positions 0..n-1 the
        result is exact."""
        t0 = time.perf_counter() if t0 is None else t0
        segments, new_ids, new_pos, layout = plan.segments, plan.new_ids, plan.new_pos, plan.layout
        n_cached = plan.cached_tokens
        capacity = n_cached + len(new_ids) + reserve
        self.adapter.check_limits(plan.max_position, capacity)
        # before the spans are placed: a tensor built from a list on a GPU waits for the stream, which
        # must not hold the (asynchronous) copies of the stored spans yet
        ids = torch.tensor([new_ids], dtype=torch.long, device=self.device)  # [1, T]
        pos = torch.tensor([new_pos], dtype=torch.long, device=self.device)  # [1, T]
        cache = self.pool.acquire(capacity, [(seg.placed, seg.n) for seg in segments])
        try:
            copied = cache.place(segments)
            if recompute is None:
                logits, redone = self.forward(ids, pos, cache)[0], 0  # [V]
            else:
                with self.lock:
                    logits, redone = run_recompute(self.adapter, cache, recompute, new_ids, new_pos,
                                                   ids, pos)
            self.sync()
        except BaseException:
            self.pool.release(cache)
            raise
        ttft = time.perf_counter() - t0
        exact = plan.exact
        if redone and redone == len(recompute.candidates) and layout is not None:
            exact = exact or list(layout.position_ids) == list(range(len(layout.position_ids)))
        if not keep_cache:
            self.pool.release(cache)
            cache = None
        return PrefillResult(logits=logits, ttft=ttft, cached_tokens=n_cached, new_tokens=len(new_ids), exact=exact,
                             bytes_copied=copied, hit_tiers=dict(plan.hit_tiers), layout=layout, cache=cache,
                             next_position=plan.max_position + 1, recomputed_tokens=redone)

    def recompute_plan(self, plan: PrefillPlan, req: RecomputeRequest) -> PrefillPlan:
        """``plan`` with the tokens ``req``'s selection chooses recomputed as rows of the serving
        step, in prompt order (``ordered.ordered_plan``): what ``prefill_spliced`` computes with
        ``recompute=req``, read from the pool instead of a private buffer."""
        scores = self.question_scores(plan, req) if req.selection in SCORED and req.budget else None
        chosen = choose(req, scores)
        return ordered_plan(plan, req, chosen, scaled_slots(req, chosen), KEY_SCALES.get(req.selection))

    def question_scores(self, plan: PrefillPlan, req: RecomputeRequest) -> torch.Tensor | None:
        """The question's attention per cached slot ([n_cached], summed over heads and the layers
        and queries ``SCORED`` names), for the selections that read it: the new tokens over the plan
        assembled in a buffer of its own (``question_pass.question_scores``: the probabilities
        are what no fused kernel returns; the one use of a private buffer on the serving path)."""
        ids = torch.tensor([plan.new_ids], dtype=torch.long, device=self.device)  # [1, T]
        pos = torch.tensor([plan.new_pos], dtype=torch.long, device=self.device)  # [1, T]
        cache = self.pool.acquire(plan.cached_tokens + len(plan.new_ids), [(seg.placed, seg.n) for seg in plan.segments])
        try:
            cache.place(plan.segments)
            with self.lock:
                return question_scores(self.adapter, cache, ids, pos, SCORED[req.selection])
        finally:
            self.pool.release(cache)

    def prefill_plain(self, token_ids: list[int], t0: float | None = None,
                      layout: PromptLayout | None = None) -> PrefillResult:
        """The reference: the stock model over ``token_ids`` at positions 0..n-1 with its ordinary
        cache (kept in the result for decoding)."""
        t0 = time.perf_counter() if t0 is None else t0
        ids = torch.tensor([token_ids], dtype=torch.long, device=self.device)  # [1, n]
        with self.lock, torch.inference_mode():
            out = self.model(input_ids=ids, use_cache=True, logits_to_keep=1)
        logits = out.logits[0, -1]  # [V]
        self.sync()
        n = len(token_ids)
        return PrefillResult(logits=logits, ttft=time.perf_counter() - t0, cached_tokens=0, new_tokens=n, exact=True,
                             layout=layout, cache=out.past_key_values, next_position=n)

    # -- buffers ----------------------------------------------------------------------------------
    def release(self, cache) -> None:
        """Give a kept SpliceCache back to the pool (a stock cache is simply dropped)."""
        if isinstance(cache, SpliceCache):
            self.pool.release(cache)

    def clear_buffers(self) -> None:
        """Drop every free assembly buffer: the next prompt allocates and copies everything."""
        self.pool.clear()

    def forget_placement(self) -> None:
        """Keep the buffers, forget what they hold: the next prompt copies every stored span."""
        self.pool.forget_residents()

    def prewarm(self, capacity: int, segments: list[Segment] = ()) -> None:
        """On CPU, have a touched buffer of ``capacity`` slots (fresh memory faults page by page)
        holding ``segments`` at slots 0.. in order, so a fresh process's first prompt that imports
        them in that order copies nothing (the copy is paid here, once, at registration)."""
        if self.device.type == "cpu":
            self.pool.prewarm(capacity, segments)

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
