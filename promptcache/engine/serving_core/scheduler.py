"""``ServingScheduler``: many requests over one ``KVPool``, one packed forward per step.

    sched = ServingScheduler(runner, pool, token_budget=512, planner=planner, chains=chains)
    sched.add(request)                 # Request(prompt spec, SamplingParams, tokenizer)
    while sched.has_work:
        for out in sched.step(): ...   # StepOutput: request id, token id, text piece, finished

A step (1) finishes what was cancelled, freeing its blocks; (2) schedules one token for every
running request that decodes and, with the budget left (``token_budget`` tokens a step in all),
the next chunk of each request still prefilling (chunked prefill: a long prompt delays the
others' next tokens by one chunk's forward, not its whole prefill); (3) admits waiting requests
in arrival order while budget is left, each with a first chunk; (4) runs ONE forward
(``paged.paged_forward``), shares the full blocks that forward completed, and samples where a
row produced logits.

A request is planned when it is admitted, so it finds the blocks that requests before it shared
up to that step: requests arriving together behind one new system prompt compute it once (the
first computes it chunk by chunk; a later one whose next block is still being computed waits
for it instead of computing it again).

Admission and memory. A request is admitted when its shared states are in the pool (or read
in place) and ``blocks_for(new tokens + max_new_tokens)`` own blocks can be allocated (idle
shared entries are evicted for them, spilled down the store's tiers); otherwise it waits, and
nothing runs out of memory. Reserving the generation's blocks up front means a running request
never needs preemption. A request that could not fit even into an empty pool fails with
``PoolFull``. Prefill writes straight into the request's own blocks (no reserve-then-copy).

Plans. At admission, on this thread (the pool is not thread-safe), the scheduler asks the one
planner (``engine/planner.py``) for the request's ``PrefillPlan`` (``plan.py``); the request's
prompt (``prompts.PromptSpec``) is data. Every prompt is planned this way: a prompt that
recomputes part of its stored states (selective recompute, documents reused out of their context) runs the chosen tokens as its own prefill rows in prompt
order, each query seeing the stored keys before it (``PagedRow.shared_limits``, from the plan's
``new_order`` and each segment's ``order``), chunked and batched like any prefill. A chain request
shares each of its own blocks (prompt, then answer) as soon as the block is full, so concurrent
requests and the next turn of a chat reuse them.

Overlapped decode (``overlap``; ``tunables.OVERLAP_STEPS``, by default on a GPU only). A step is
launched (``_launch``: its forward and the argmax of its rows, queued on the device) and then
finished (``_finish``: the argmax read back once, each row's token taken: stop checks, text,
outputs). When every row of a step is a decode row of a running plain greedy request (no
log-probabilities, no end-of-sequence masking, every running request in the step, nothing waiting
to be admitted), the next step is launched between the two (``_go_ahead``, ``_launch_ahead``): its
input ids are this step's argmax on the device, its positions and slots the next ones, so the
device computes step N+1 while the host reads and streams step N; a request whose token at step N
is its last by length is left out of it. The host's copy of those ids is a placeholder (``AHEAD``, read by no
forward) until ``_finish`` sets it; the blocks the step completed are shared then, under the
tokens' keys. A request that stops at step N (an end-of-sequence token, a stop string) or is
cancelled had its row of step N+1 computed for nothing: that row is dropped. Outputs are the
same, step for step, as without the overlap (tests/engine/test_overlap.py); each ``step()`` call
still returns one step's outputs.

Paused requests (``Request.paused``: the client stopped reading) are left out of decode steps
until resumed. ``step()`` is not thread-safe: one thread drives it (the server's worker).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass

import torch

from ... import tunables
from ...tunables import MIN_CHUNK
from ...kernels import attention as cpu_attention
from .dense import on_device, pool_run
from .kvpool import KVPool, PoolFull, SharedEntry
from .paged import PagedRow, key_rule, paged_forward
from .prefix import PrefixCache
from ..prefill.plan import PrefillPlan
from .request import PoolState, Request, Status, StepOutput
from ..prefill.results import PrefillResult
from ..prefill.runner import ModelRunner

log = logging.getLogger(__name__)

__all__ = ["ServingScheduler"]



AHEAD = -1  # the host's id of a token a step launched ahead reads from the device (set once read back)


@dataclass(eq=False)
class _Flight:
    """A step whose forward was launched: its requests and rows, the logits [k, V] of its logits
    rows and their argmax [k] on the device (None: not taken), not yet read back by the host."""

    reqs: list[Request]
    rows: list[PagedRow]
    logits: torch.Tensor
    picks: torch.Tensor | None
    host: torch.Tensor | None = None  # on a GPU: ``picks`` copied to pinned host memory without blocking
    copied: object | None = None  # the CUDA event recorded after that copy


def _last_token(r: Request) -> bool:
    """Whether the token ``r`` samples next is its last by length (``max_new_tokens``)."""
    return len(r.token_ids) + 1 >= r.params.max_new_tokens


def _read_back(picks: torch.Tensor | None) -> tuple[torch.Tensor | None, object | None]:
    """On a GPU, the step's argmax copied to pinned host memory now, without blocking, and an event
    after the copy: reading it then waits for this step alone. ``picks.tolist()`` would wait for
    every kernel queued before the read, the step launched ahead of it included."""
    if picks is None or picks.device.type != "cuda":
        return None, None
    host = torch.empty(picks.shape, dtype=picks.dtype, pin_memory=True)
    host.copy_(picks, non_blocking=True)
    copied = torch.cuda.Event()
    copied.record()
    return host, copied


class RequestQueue:
    """Requests waiting in arrival order, the ones running, and adding a new request."""

    def __init__(self):
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.decode_forwards = 0  # forwards run for decoding (a batched step counts once)
        self.decode_tokens = 0  # tokens they decoded (decode_tokens / decode_forwards: mean batch size)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, request: Request) -> None:
        if request.status is not Status.WAITING:
            raise ValueError(f"request {request.id} is {request.status.value}; only a new request can be added")
        request.submitted = request.submitted or time.perf_counter()  # an engine sets it at submission
        self.waiting.append(request)


class ServingScheduler(RequestQueue):
    def __init__(self, runner: ModelRunner, pool: KVPool, token_budget: int = 512, max_running: int = 256,
                 on_publish=None, forward=None, *, planner, chains: PrefixCache | None = None):
        """``forward(pool, rows) -> logits``: the step's forward (default ``paged.paged_forward``;
        ``graphs.CompiledSteps.forward`` compiles the small ones). ``planner``: what plans each
        request at admission (``engine/planner.Planner``: ``plan(spec, pool, chains)``); ``chains``:
        the prefix chains token prompts that reuse are planned through (None: such prompts fail)."""
        if token_budget < 1 or max_running < 1:
            raise ValueError(f"token_budget and max_running must be >= 1, got {token_budget}, {max_running}")
        super().__init__()
        self.runner, self.pool, self.planner, self.chains = runner, pool, planner, chains
        self.token_budget, self.max_running = token_budget, max_running
        self.on_publish = on_publish  # (key, kv view [L, 2, H, n, D]) for each block a request published
        self.forward = forward or (lambda pool, rows: paged_forward(runner, pool, rows))
        self.steps = 0
        # the last step's sampled ids on the device ([k], one a logits row) and the requests they were
        # taken for, in order, where every one took its row's argmax and goes on decoding (else None):
        # the next step's input ids when it decodes exactly those requests (``PagedRow.sampled``)
        self._sampled: tuple[torch.Tensor, list[Request]] | None = None
        self.device_ids = True  # keep them (False: every step's input ids are made from the host's)
        # overlapped decode (``tunables.OVERLAP_STEPS``; "auto": on a GPU): a steady greedy batch's next
        # step launched before this one's tokens are read (``_go_ahead``); ``_ahead``: that step, launched,
        # not yet read; ``ahead_steps``: steps launched so, ahead of reading the one before
        self.overlap = tunables.OVERLAP_STEPS is True or (tunables.OVERLAP_STEPS == "auto"
                                                           and pool.buf.device.type == "cuda")
        self._ahead: _Flight | None = None
        self.ahead_steps = 0
        self.device_id_steps = 0  # steps whose input ids were the last step's sampled ids, on the device
        self.prefill_tokens = 0
        self.published_blocks = 0  # own blocks requests shared under chain keys
        if pool.buf.device.type == "cpu":
            cpu_attention.available()  # build or load the native kernel now, not in the first request's step

    def step(self) -> list[StepOutput]:
        """One step; its outputs are returned and also appended to each request's ``outputs``. With
        ``overlap``, a step may be the one the last call launched ahead (its forward already running),
        and may launch the next one before reading its own tokens (``_go_ahead``)."""
        outs = self._cancel()
        flight, self._ahead = self._ahead, None
        if flight is None:
            reqs, rows, budget = self._schedule()
            outs += self._admit(reqs, rows, budget)
            if not rows:
                self.steps += 1
                return outs
            flight = self._launch(reqs, rows)
        if self._go_ahead(flight):
            self._ahead = self._launch_ahead(flight)
            self.ahead_steps += 1
        outs += self._finish(flight)
        self.steps += 1
        return outs

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self._ahead is not None)

    # -- cancellation -----------------------------------------------------------------------------
    def _cancel(self) -> list[StepOutput]:
        outs = []
        for req in [r for r in self.waiting if r.cancel_requested]:
            self.waiting.remove(req)
            outs.append(self._ended(req, "cancelled"))
        for req in [r for r in self.running if r.cancel_requested]:
            self._release(req)
            outs.append(self._ended(req, "cancelled"))
        return outs

    def _ended(self, req: Request, reason: str) -> StepOutput:
        req.finish_reason, req.status = reason, Status.FINISHED
        return req.emit(None, "")

    # -- scheduling -------------------------------------------------------------------------------
    def _schedule(self) -> tuple[list[Request], list[PagedRow], int]:
        """Decode rows of the running requests, then the next chunk of those still prefilling;
        and the budget left for new requests (prefill gets at least ``MIN_CHUNK`` a step)."""
        reqs = [r for r in self.running if not r.prefilling and not r.paused and r.pending is not None]
        kept = self._sampled
        same = kept is not None and len(kept[1]) == len(reqs) and all(a is b for a, b in zip(kept[1], reqs))
        rows = [self._row(r, [r.pending], [r.position], True, sampled=kept[0] if same else None) for r in reqs]
        budget = max(self.token_budget - len(rows), MIN_CHUNK)
        for r in self.running:
            if budget <= 0:
                break
            if r.prefilling:
                row = self._chunk(r, budget)
                budget -= len(row.ids)
                rows.append(row)
                reqs.append(r)
        return reqs, rows, max(budget, 0)

    def _row(self, r: Request, ids: list[int], pos: list[int], logits: bool,
             limits: list[torch.Tensor | None] | None = None, sampled: torch.Tensor | None = None) -> PagedRow:
        kv = r.kv
        done = len(kv.own_ids)
        kv.own_ids.extend(ids)  # their states are written by this step's forward
        kv.own_pos.extend(pos)
        # the whole slot table and the count: the row's slots are sliced only where a step reads them
        return PagedRow(ids, pos, kv.shared, kv.slots, logits=logits, shared_pos=kv.shared_pos,
                        shared_slots=kv.shared_slots, own_pos=kv.own_pos, shared_limits=limits,
                        shared_shift=kv.shared_shift, own_blocks=kv.blocks, shared_runs=kv.shared_runs,
                        sampled=sampled, own_count=done + len(ids))

    def _chunk(self, r: Request, budget: int) -> PagedRow:
        kv, plan = r.kv, r.kv.plan
        lo = len(kv.own_ids)
        hi = min(len(plan.new_ids), lo + budget)
        limits = None
        if kv.shared_order is not None:  # a plan in prompt order: each query sees the shared keys before it
            q = torch.tensor(plan.new_order[lo:hi], dtype=torch.long)
            limits = [_limits(order, q) for order in kv.shared_order]
        return self._row(r, plan.new_ids[lo:hi], plan.new_pos[lo:hi], hi == len(plan.new_ids), limits)

    # -- admission --------------------------------------------------------------------------------
    def _admit(self, reqs: list[Request], rows: list[PagedRow], budget: int) -> list[StepOutput]:
        """Admit waiting requests in arrival order while budget is left; each gets a first chunk
        in ``rows``. A request whose next block another request is computing now waits a step."""
        if not self.waiting:
            return []
        outs, inflight, deferred = [], self._inflight(), []
        while self.waiting and budget > 0 and len(self.running) < self.max_running:
            req = self.waiting.popleft()
            try:
                how = self._admit_one(req, inflight)
            except Exception as e:  # noqa: BLE001 - this request fails; the others go on
                req.error = e
                outs.append(self._ended(req, "cancelled"))
                continue
            if how == "later":
                deferred.append(req)
                continue
            if how is None:
                self.waiting.appendleft(req)  # no room now: it waits for running requests to finish
                break
            self.running.append(req)
            row = self._chunk(req, budget)
            budget -= len(row.ids)
            rows.append(row)
            reqs.append(req)
            inflight |= self._inflight_of(req)
        self.waiting.extendleft(reversed(deferred))
        return outs

    def _inflight(self) -> set[str]:
        keys: set[str] = set()
        for r in self.running:
            keys |= self._inflight_of(r)
        return keys

    def _inflight_of(self, r: Request) -> set[str]:
        """Chain keys of the prompt blocks ``r`` has not shared yet (being computed, this step included)."""
        if r.kv.plan.publish is None or not r.kv.publishing:
            return set()
        return set(r.kv.plan.publish(r.kv.plan.new_ids)[r.kv.published :])

    def _admit_one(self, req: Request, inflight: set[str]):
        """"admitted", "later" (its first block is being computed) or None (no room now)."""
        plan = self.planner.plan(req.prompt, self.pool, self.chains)
        if plan.publish is not None and inflight:
            first = plan.publish(plan.new_ids[: self.pool.block_size])
            if first and first[0] in inflight and self.running:
                return "later"
        own = self.pool.blocks_for(len(plan.new_ids) + req.params.max_new_tokens)
        entries, shared, copied = self._resolve(plan, own)
        if shared is None:
            return self._no_room(req, entries, plan.cached_tokens)
        blocks = self.pool.allocate(own)
        if blocks is None:
            return self._no_room(req, entries, plan.cached_tokens)
        # the views hold the segments' tokens in KV order: their positions, cut at the views' lengths
        positions = torch.cat([seg.positions.to("cpu", torch.long) for seg in plan.segments]) if shared else None
        lengths = [v.shape[3] for _, v, _, _ in shared]
        order = None
        if plan.new_order is not None:  # the prompt index of every shared key, split as the views are
            order = torch.cat([torch.arange(seg.order, seg.order + seg.n) for seg in plan.segments]) if shared \
                else torch.zeros(0, dtype=torch.long)
            order = list(order.split(lengths))
        req.admit(PoolState(
            plan=plan, entries=entries, shared=[(k, v) for k, v, _, _ in shared], blocks=blocks,
            slots=self._slots_of(blocks), bytes_copied=copied,
            shared_pos=list(positions.split(lengths)) if shared else [],
            shared_slots=[slots for _, _, slots, _ in shared], shared_order=order,
            shared_runs=[pool_run(self.pool.buf, v) if slots is not None else None for _, v, slots, _ in shared],
            shared_shift=[shift for _, _, _, shift in shared] if any(seg.shift for seg in plan.segments) else None))
        return "admitted"

    def _slots_of(self, blocks: list[int]) -> torch.Tensor:
        """Pool slots of every token the request's own blocks can hold (built once: rows slice it)."""
        return self.pool.slots(blocks, 0, len(blocks) * self.pool.block_size)

    def _no_room(self, req: Request, entries: list[SharedEntry], cached: int):
        for e in entries:
            self.pool.release(e)
        if not self.running:  # nothing will free blocks: it can never fit
            raise PoolFull(f"request {req.id} needs more KV blocks than the pool has free with nothing running "
                           f"({cached} cached tokens, {self.pool.num_blocks} blocks of {self.pool.block_size}); "
                           "raise the pool size")
        return None

    @property
    def pools_documents(self) -> bool:
        """Whether stored states this step could read in place (a store tier's tensors on the pool's
        device and dtype: documents, modules) are copied into the pool once instead, as shared
        read-only entries (``tunables.POOL_DOCUMENTS``): without the native CPU kernel (the path a GPU
        takes) a step's attention is one call a layer over keys the pool holds (``dense.py``), where
        each (document, shift) read from a store tensor is a call and a merge of its own. The native
        kernel reads store tensors as runs of its one call, and models whose attention reads key
        positions (ALiBi, sliding windows: ``paged.KeyRule``) keep their own path: there they stay in
        place."""
        if not tunables.POOL_DOCUMENTS or cpu_attention.gathers(self.pool.buf):
            return False
        return key_rule(self.runner.adapter) is None

    def _resolve(self, plan: PrefillPlan, reserve: int = 0):
        """Pin the plan's segments: pool entries acquired, states on another device or dtype
        promoted into the pool, the rest read in place, or (``pools_documents``) promoted too while
        ``reserve`` blocks (the request's own) stay available; a run of a stored segment
        (``Segment.part_of``) then reads the whole one's entry. Returns (entries, shared (key, view,
        pool slots or None for a store tensor read in place, shift), bytes copied); shared is None
        when promotion found no room."""
        pool, copied = self.pool, 0
        pooled = self.pools_documents
        # the entry each segment reads: its own, or the whole stored segment it is a run of
        homes = [seg.part_of[0] if pooled and seg.part_of is not None else seg.key for seg in plan.segments]
        held = [pool.acquire(key) for key in homes]  # first: pinned before anything is evicted
        entries = [e for e in held if e is not None]
        room = pool.available_blocks - reserve if pooled else 0  # blocks copies may take (summed once)
        for i, seg in enumerate(plan.segments):
            if held[i] is None and homes[i] != seg.key:  # another run of its document promoted it just now
                held[i] = pool.acquire(homes[i])
                if held[i] is not None:
                    entries.append(held[i])
            if held[i] is not None:
                continue
            if seg.kv is None:
                if seg.load is None:
                    raise RuntimeError(f"plan segment {seg.key} is neither in the pool nor given")
                seg.kv = seg.load()  # states made when first needed (a document moved to its position)
            must = seg.promote or not _in_place(seg.kv, pool)
            kv, first = (seg.part_of[1], seg.part_of[2]) if homes[i] != seg.key else (seg.kv, 0)
            if not must and not (pooled and room >= pool.blocks_for(kv.shape[3])):
                continue  # read in place
            # the positions the states were encoded at (computed where the positions are: no device sync)
            encoded = seg.positions - seg.shift if kv is seg.kv else \
                torch.arange(kv.shape[3], device=seg.positions.device) + (seg.positions[:1] - seg.shift - first)
            held[i] = pool.promote(homes[i], kv, encoded, copy=not must)
            if held[i] is None:
                if must:
                    return entries, None, copied
                continue
            entries.append(held[i])
            copied += kv.numel() * kv.element_size()
            room -= len(held[i].blocks)
        shared: list[tuple[str, torch.Tensor, torch.Tensor | None, int]] = []
        chain: list[SharedEntry] = []  # consecutive full pool entries read at one shift: coalesced into runs
        shift = 0
        for seg, entry, home in zip(plan.segments, held, homes):
            if entry is None or seg.shift != shift or home != seg.key:
                shared += self._runs(chain, shift)
                chain, shift = [], seg.shift
            if entry is None:  # read in place from the store's tensor
                shared.append((seg.key, seg.kv, None, seg.shift))
                continue
            if home != seg.key:  # a run of a stored segment the pool holds whole: its tokens' slots there
                shared += self._part(entry, seg.part_of[2], seg.n, seg.shift)
                continue
            chain.append(entry)
            if entry.n != len(entry.blocks) * pool.block_size:  # partial: ends a run
                shared += self._runs(chain, shift)
                chain = []
        shared += self._runs(chain, shift)
        return entries, shared, copied

    def _part(self, entry: SharedEntry, first: int, n: int, shift: int
              ) -> list[tuple[str, torch.Tensor, torch.Tensor, int]]:
        """Tokens [first, first + n) of a pool entry as views of contiguous runs, as ``_runs`` gives them."""
        out, off = [], 0
        for start, count in self.pool.slot_runs(entry.blocks, entry.n):
            lo, hi = max(first, off), min(first + n, off + count)
            if lo < hi:
                a, k = start + lo - off, hi - lo
                out.append((f"pool:{a}:{k}", self.pool.buf[:, :, :, a : a + k],
                            torch.arange(a, a + k, device=self.pool.buf.device), shift))
            off += count
        return out

    def _runs(self, chain: list[SharedEntry], shift: int) -> list[tuple[str, torch.Tensor, torch.Tensor, int]]:
        """Consecutive pool entries as views of contiguous runs: (key, view, the run's pool slots, shift)."""
        if not chain:
            return []
        blocks = [b for e in chain for b in e.blocks]
        views, out, slot = self.pool.views(blocks, sum(e.n for e in chain)), [], 0
        for v in views:
            start = blocks[slot // self.pool.block_size] * self.pool.block_size
            slots = torch.arange(start, start + v.shape[3], device=self.pool.buf.device)
            out.append((f"pool:{start}:{v.shape[3]}", v, slots, shift))
            slot += v.shape[3]
        return out

    # -- one step ---------------------------------------------------------------------------------
    def _launch(self, reqs: list[Request], rows: list[PagedRow], publish: bool = True) -> "_Flight":
        """Run the step's forward and its argmax (on a GPU: queued, nothing read back); ``publish``:
        share the blocks it completed now (a step launched ahead shares them once its input tokens
        are known: ``_finish`` of the step before it)."""
        self._sampled = None
        if rows[0].sampled is not None and len(rows) == rows[0].sampled.shape[0]:
            self.device_id_steps += 1
        try:
            logits = self.forward(self.pool, rows)  # [k, V]
        except BaseException as e:
            for r in reqs:
                r.error = e
                self._release(r)
                r.finish_reason, r.status = "cancelled", Status.FINISHED
            raise
        if publish:
            for r in reqs:
                self._publish(r)
        # the argmax of every row in one call (float32: a bfloat16 argmax row by row costs 10x),
        # read by the plain greedy requests; kept on the device for the next step's input ids, read
        # back once (``_finish``) for the stop checks and the text. A row is indexed only where its
        # request reads its logits (a prefill's first token, sampling, log-probabilities, a masked
        # EOS): a plain greedy decode row makes no tensor op of its own
        greedy = any(r.sampler.plain_greedy for r in reqs)
        picks = (logits if logits.dtype == torch.float32 else logits.float()).argmax(-1) if greedy else None
        return _Flight(reqs, rows, logits, picks, *_read_back(picks))

    def _go_ahead(self, flight: "_Flight") -> bool:
        """Whether the next step can be launched before this one's tokens are read: ``overlap`` on,
        nobody waiting to be admitted, every running request in the step (in order, as ``_schedule``
        lists them), every row of the step a decode row of a running plain greedy request (no
        log-probabilities, no end-of-sequence masking left, not paused or cancelled), and one of
        them with tokens left after this step: the next step decodes those from this step's argmax
        (``_launch_ahead``). A request that stops at this step on an end-of-sequence token or a stop
        string (unknown before its token is read) had its row in the next step computed for
        nothing: ``_finish`` drops it."""
        if not self.overlap or not self.device_ids or flight.picks is None or self.waiting:
            return False
        if len(self.running) != len(flight.reqs) or any(a is not b for a, b in zip(self.running, flight.reqs)):
            return False  # a running request outside this step (paused, resumed, prefilling): it must be scheduled
        eos = self.runner.eos_ids
        for r, row in zip(flight.reqs, flight.rows):
            if len(row.ids) != 1 or not row.logits or r.pending is None \
                    or not r.sampler.plain_greedy or r.top_logprobs is not None or r.paused or r.cancel_requested \
                    or (eos and len(r.token_ids) < r.params.min_tokens):
                return False
        return any(not _last_token(r) for r in flight.reqs)

    def _launch_ahead(self, flight: "_Flight") -> "_Flight":
        """The step after ``flight``, launched before its tokens are read: a row for each of its
        requests with tokens left after it (one whose ``flight`` token is its last, by length, is
        left out), each reading its ``flight`` argmax on the device. The host's copies of those ids
        (``AHEAD``, which no forward reads) are set by ``_finish``."""
        keep = [i for i, r in enumerate(flight.reqs) if not _last_token(r)]
        picks = flight.picks
        if len(keep) < len(flight.reqs):  # the continuing rows' argmax, gathered on the device
            picks = picks.index_select(0, on_device(keep, picks.device))
        reqs = [flight.reqs[i] for i in keep]
        return self._launch(reqs, [self._row(r, [AHEAD], [r.position + 1], True, sampled=picks) for r in reqs],
                            publish=False)

    def _finish(self, flight: "_Flight") -> list[StepOutput]:
        """Read the step's tokens back (once) and take them: sampling, stop checks, text, outputs.
        Rows of requests that finished after the step was launched (ahead) are dropped."""
        reqs, rows, logits, picks = flight.reqs, flight.rows, flight.logits, flight.picks
        outs, k = [], 0
        decoded = 0
        if flight.copied is not None:  # the argmax's copy to the host, queued before any step launched after it
            flight.copied.synchronize()
            best = flight.host.tolist()
        else:
            best = picks.tolist() if picks is not None else None
        eos = self.runner.eos_ids
        took = []  # the requests of the logits rows, in order
        for r, row in zip(reqs, rows):
            was_prefill = len(row.ids) > 1 or r.pending is None
            if not row.logits:
                self.prefill_tokens += len(row.ids)
                continue
            at = k
            k += 1
            if r.finished:  # stopped or cancelled since this step was launched ahead of it
                continue
            took.append(r)
            if was_prefill:
                self.prefill_tokens += len(row.ids)
                outs.append(self._guard(r, lambda: self._first_token(r, self._prefill_result(r, logits[at]))))
            else:
                decoded += 1
                r.position += 1
                pick = best[at] if best is not None else None
                lg = logits[at] if r.reads_logits(pick, eos) else None
                outs.append(self._guard(r, lambda: self._sample(r, lg, pick)))
        if decoded:
            self.decode_forwards += 1
            self.decode_tokens += decoded
        ahead = self._ahead
        if ahead is not None:  # the next step was launched with this one's argmax: its host ids, then its blocks
            for r in ahead.reqs:
                if not r.finished:
                    r.kv.own_ids[-1] = r.pending
                    self._publish(r)
            if all(r.finished for r in ahead.reqs):
                self._ahead = None  # every row of it was for nothing
        elif self.device_ids and best is not None and len(took) == len(best) \
                and all(r.pending == b for r, b in zip(took, best)):  # each its argmax
            self._sampled = (picks, took)
        return outs

    def _prefill_result(self, req: Request, logits: torch.Tensor) -> PrefillResult:
        plan = req.kv.plan
        if self.runner.device.type == "cuda":
            torch.cuda.synchronize(self.runner.device)
        return PrefillResult(logits=logits, ttft=time.perf_counter() - req.submitted,
                             cached_tokens=plan.cached_tokens + plan.recomputed,
                             new_tokens=len(plan.new_ids) - plan.recomputed, exact=plan.exact,
                             bytes_copied=req.kv.bytes_copied, hit_tiers=dict(plan.hit_tiers), layout=plan.layout,
                             next_position=plan.max_position + 1, recomputed_tokens=plan.recomputed)

    def _first_token(self, req: Request, res: PrefillResult) -> StepOutput:
        req.begin(res)
        if req.params.max_new_tokens == 0:
            self._release(req)
            return self._ended(req, "length")
        return self._sample(req, res.logits)

    def _guard(self, req: Request, fn):
        try:
            return fn()
        except BaseException as e:
            req.error = e
            self._release(req)
            req.finish_reason, req.status = "cancelled", Status.FINISHED
            raise

    def _sample(self, req: Request, logits: torch.Tensor | None, argmax: int | None = None) -> StepOutput:
        token, piece, entry = req.sample_next(logits, self.runner.eos_ids, argmax)
        if req.finish_reason is not None:
            self._release(req)
            req.status = Status.FINISHED
        return req.emit(token, piece, entry)

    # -- finishing --------------------------------------------------------------------------------
    def _release(self, req: Request) -> None:
        """Give back what the request holds: its unshared own blocks and its entry references
        (shared blocks stay, idle, for the next request that matches them)."""
        if req in self.running:
            self.running.remove(req)
        if req.kv is None:  # never admitted: it holds nothing
            return
        self.pool.free(req.kv.blocks[req.kv.published :])
        req.kv.blocks = []
        for e in req.kv.entries:
            self.pool.release(e)
        req.kv.entries = []

    def _publish(self, req: Request) -> None:
        """Share the request's own blocks completed so far under their chain keys. Leading blocks
        only: a block whose key is already shared ends it (the request keeps the rest)."""
        bs = self.pool.block_size
        if req.kv.plan.publish is None or not req.kv.publishing or len(req.kv.own_ids) < (req.kv.published + 1) * bs:
            return  # (the last: no full block past those shared, asked of every row every step)
        keys = req.kv.plan.publish(req.kv.own_ids)
        while req.kv.published < len(keys):
            j = req.kv.published
            pos = torch.tensor(req.kv.own_pos[j * bs : (j + 1) * bs], dtype=torch.long)
            entry = self.pool.publish(keys[j], [req.kv.blocks[j]], bs, pos)
            if entry is None:  # another request shared the same block first: keep ours (and the rest) private
                req.kv.publishing = False
                return
            self.pool.acquire(keys[j])  # it still reads the block
            req.kv.entries.append(entry)
            req.kv.published += 1
            self.published_blocks += 1
            if self.on_publish is not None:
                self.on_publish(keys[j], entry.views[0])


def _limits(order: torch.Tensor, queries: torch.Tensor) -> torch.Tensor | None:
    """How many leading keys of a shared view (prompt indices ``order`` [n], ascending) each query
    (prompt indices ``queries`` [t]) sees: those at or before it. None: every query sees all."""
    limits = torch.searchsorted(order, queries, right=True)
    return None if bool((limits == len(order)).all()) else limits


def _in_place(kv: torch.Tensor, pool: KVPool) -> bool:
    """Stored states attention can read where they are (the pool's device and dtype)."""
    return kv.device == pool.buf.device and kv.dtype == pool.buf.dtype

