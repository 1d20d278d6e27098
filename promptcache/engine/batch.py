"""``DecodeBatch``: one decode step of several running requests as ONE forward (continuous batching).

The batch owns a ``SpliceCache`` with one row per request (``batch=B``). A request joins once,
after its prefill: its prefilled cache (batch 1, slots [0, n)) is copied into a free row and
given back to the pool. Every step then appends one token per row at the same slot ``L`` (the
batch cache's length: the adapter's append path, no per-row scatter) under an attention mask
``[B, 1, 1, L + 1]`` in which row r sees only the slots it filled itself (``valid[r]``) and its
new token. Rows of different prompt lengths thus share one buffer; the slots a row never wrote
(its gap) are zero-initialised and masked out (never garbage: 0 * NaN would leak through softmax).

Decisions (CPU measurements in eval/results/serving.md):
  * A request leaves by marking its row dead (no copy); a dead row is reused by the next request
    that joins. Dead rows still run through the forward (a pad token attending only to itself),
    so the batch is repacked (live rows gathered to the front, dead rows dropped) when dead rows
    outnumber live ones, when the shared length ``L`` outgrows twice the longest live row (rows
    that joined late leave gaps), or when a step needs a slot past the capacity.
  * Only SpliceCache requests batch (the stock-cache baseline path does not), and only where the
    adapter takes custom masks (``check_mask_support``); elsewhere the scheduler steps requests
    one forward each and logs why once.
  * Logits of a batched step differ from a one-request step only by float rounding (masked
    attention over a longer, zero-padded key range); greedy tokens are equal (tests).
"""

from __future__ import annotations

import logging

import torch

from ..cache import SpliceCache
from ..models import UnsupportedModelError
from ..tunables import DECODE_SLACK
from .request import Request
from .runner import ModelRunner

log = logging.getLogger(__name__)

__all__ = ["DecodeBatch", "batch_refusal"]



def batch_refusal(runner: ModelRunner) -> str | None:
    """Why this runner's model cannot decode several requests in one forward (None: it can)."""
    try:
        runner.adapter.check_mask_support()
    except UnsupportedModelError as e:
        return str(e)
    return None


class DecodeBatch:
    """The running requests that decode together; ``step()`` -> logits [B, V], one row per member."""

    def __init__(self, runner: ModelRunner):
        self.runner = runner
        self.rows: list[Request | None] = []  # row -> member (None: a dead row, free for reuse)
        self.cache: SpliceCache | None = None  # [L, 2, B, H, S, D]
        self.valid: torch.Tensor | None = None  # bool [B, S]: slots row b attends to
        self.repacks = 0  # how many times live rows were gathered into a new buffer (for tests/metrics)

    def __contains__(self, req: Request) -> bool:
        return any(r is req for r in self.rows)

    @property
    def members(self) -> list[Request]:
        return [r for r in self.rows if r is not None]

    def join(self, reqs: list[Request]) -> None:
        """Move prefilled requests (SpliceCache, batch 1) into rows; their caches go back to the pool."""
        free = [i for i, r in enumerate(self.rows) if r is None]
        if len(reqs) > len(free):
            self._repack(reqs)
        else:
            for req, row in zip(reqs, free):
                self._place(req, row)
        for req in reqs:
            self.runner.release(req.prefill.cache)
            req.prefill.cache = None

    def leave(self, req: Request) -> None:
        """Free the request's row (its slots are masked from now on; the row is reused later)."""
        for i, r in enumerate(self.rows):
            if r is req:
                self.rows[i] = None
                self.valid[i] = False
        if not self.members:  # nothing left: drop the buffer
            self.rows, self.cache, self.valid = [], None, None

    def step(self) -> torch.Tensor:
        """One token for every member (``pending`` at ``position``): logits [B, V], row order = ``rows``
        (dead rows' logits are meaningless). The caller advances positions and samples per row."""
        live = self.members
        longest = int(self.valid.sum(dim=1).max())
        if (len(self.rows) - len(live) > len(live) or self.cache.length > 2 * longest + DECODE_SLACK
                or self.cache.length + 1 > self.cache.capacity):
            self._repack([])
        cache, dev = self.cache, self.cache.buf.device
        n = cache.length
        ids = torch.tensor([[r.pending if r is not None else 0] for r in self.rows], dtype=torch.long, device=dev)
        pos = torch.tensor([[r.position if r is not None else 0] for r in self.rows], dtype=torch.long, device=dev)
        mask = self.valid[:, : n + 1].clone()  # [B, n + 1]
        mask[:, n] = True  # every row (a dead one too) sees its new token
        with self.runner.lock:
            logits = self.runner.adapter.forward(ids, pos, cache, attention_mask=mask[:, None, None, :])  # [B, V]
        alive = torch.tensor([r is not None for r in self.rows], device=dev)
        self.valid[:, n] = alive
        return logits

    # -- rows -------------------------------------------------------------------------------------
    def _need(self, reqs: list[Request]) -> int:
        """Slots still to be generated by the longest-remaining of ``reqs``."""
        return max((r.params.max_new_tokens - len(r.token_ids) for r in reqs), default=0)

    def _place(self, req: Request, row: int) -> None:
        """Copy a prefilled cache (slots [0, k)) into a free row; the shared length becomes max(L, k)."""
        src = req.prefill.cache
        k = src.length
        length = max(self.cache.length, k)
        self._grow(length + self._need([*self.members, req]) + 1)
        src.sync()  # its placed spans may still be arriving on a side stream (GPU)
        self.cache.write(0, src.buf[:, :, 0, :, :k], src.positions[0, :k], row=row)
        self.valid[row] = False
        self.valid[row, :k] = True
        self.cache.set_length(length)
        self.rows[row] = req

    def _grow(self, capacity: int) -> None:
        old = self.cache.capacity
        if capacity <= old:
            return
        self.cache.ensure_capacity(capacity + DECODE_SLACK)
        self.cache.buf[..., old:, :].zero_()  # the grown tail is uninitialised memory
        valid = self.valid.new_zeros((len(self.rows), self.cache.capacity))
        valid[:, :old] = self.valid
        self.valid = valid

    def _repack(self, joining: list[Request]) -> None:
        """A new buffer with one row per live member then per joining request, each row's valid slots
        gathered to its front (in slot order, so attention sees the same keys)."""
        spans = []  # (request, kv [L, 2, H, k, D], positions [k])
        for i, req in enumerate(self.rows):
            if req is not None:
                idx = self.valid[i].nonzero().squeeze(1)  # [k]
                spans.append((req, self.cache.buf[:, :, i].index_select(3, idx), self.cache.positions[i, idx]))
        for req in joining:
            src = req.prefill.cache
            src.sync()
            spans.append((req, src.buf[:, :, 0, :, : src.length], src.positions[0, : src.length]))
        length = max(kv.shape[3] for _, kv, _ in spans)
        capacity = length + self._need([r for r, _, _ in spans]) + 1 + DECODE_SLACK
        cache = SpliceCache(self.runner.spec, capacity, batch=len(spans), device=self.runner.device)
        cache.buf.zero_()
        valid = torch.zeros((len(spans), capacity), dtype=torch.bool, device=self.runner.device)
        for row, (_, kv, pos) in enumerate(spans):
            cache.write(0, kv, pos, row=row)
            valid[row, : kv.shape[3]] = True
        cache.set_length(length)
        self.rows, self.cache, self.valid = [r for r, _, _ in spans], cache, valid
        self.repacks += 1
        log.debug("decode batch repacked: %d rows, length %d, capacity %d", len(spans), length, capacity)
