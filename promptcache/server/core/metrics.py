"""Prometheus metrics of one server (its own registry, so several apps in a process never mix)."""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client import CONTENT_TYPE_LATEST
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from .counts import TokenCounts

# the shared (Redis) tier's counters (TieredStore.shared_stats) -> metric name, help
REMOTE = {"hits": ("promptcache_remote_hits", "stored states fetched from the shared tier (verified)"),
          "errors": ("promptcache_remote_errors", "shared tier failures (down, slow, full): served locally"),
          "corrupt": ("promptcache_remote_corrupt", "shared values that failed verification (deleted, re-encoded)")}


class Metrics:
    content_type = CONTENT_TYPE_LATEST  # of ``render()``

    def __init__(self, backend, prefix_cache, store):
        r = self.registry = CollectorRegistry()
        self.requests = Counter("promptcache_requests", "HTTP requests answered", ["endpoint", "status"], registry=r)
        # prompt = cached + recomputed + new (counts.py: the definition usage, access log and studio share)
        self.prompt_tokens = Counter("promptcache_prompt_tokens", "prompt tokens served", registry=r)
        self.cached_tokens = Counter("promptcache_cached_tokens", "prompt tokens served from stored states "
                                     "(not computed for the request)", registry=r)
        self.recomputed_tokens = Counter("promptcache_recomputed_tokens", "prompt tokens laid out from stored "
                                         "states but computed afresh in the prompt's context", registry=r)
        self.new_tokens = Counter("promptcache_new_tokens", "prompt tokens with no stored states, run through "
                                  "the model", registry=r)
        self.generated_tokens = Counter("promptcache_generated_tokens", "tokens generated", registry=r)
        self.finished = Counter("promptcache_requests_finished", "engine requests by outcome",
                                ["outcome"], registry=r)  # done, error, cancelled
        self.ttft = Histogram("promptcache_ttft_seconds", "time from queueing to the prompt's logits",
                              buckets=(.005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10, 30), registry=r)
        Gauge("promptcache_requests_in_flight", "requests admitted and not finished (queued + running)",
              registry=r).set_function(lambda: backend.in_flight)
        Gauge("promptcache_requests_running", "requests the engine steps now (prefilling or decoding)",
              registry=r).set_function(lambda: len(backend.scheduler.running))
        Gauge("promptcache_requests_queued", "requests admitted and waiting for room in the KV pool or a step",
              registry=r).set_function(lambda: max(0, backend.in_flight - len(backend.scheduler.running)))
        self.tier_hits = Counter("promptcache_tier_hits", "stored spans (prefix blocks, modules, documents) a "
                                 "prompt was served from, by the tier that held them", ["tier"], registry=r)
        Gauge("promptcache_prefix_blocks_stored", "prefix blocks stored (shared in the KV pool or put into the store)",
              registry=r).set_function(lambda: prefix_cache.blocks_stored + backend.published_blocks)
        Gauge("promptcache_decode_forwards", "forwards run for decoding (a batched step counts once)",
              registry=r).set_function(lambda: backend.scheduler.decode_forwards)
        Gauge("promptcache_decode_tokens", "tokens decoded by those forwards (tokens / forwards: mean batch)",
              registry=r).set_function(lambda: backend.scheduler.decode_tokens)
        Gauge("promptcache_kv_pool_bytes", "bytes of the KV pool (allocated at start; on CPU resident as its blocks are "
              "first used)", registry=r).set_function(lambda: backend.pool.buf.numel() * backend.pool.buf.element_size())
        Gauge("promptcache_kv_pool_resident_bytes", "bytes of the KV pool resident in memory (on CPU: the pages of "
              "blocks written at least once; -1 where unknown: a GPU pool, no mincore)", registry=r).set_function(
            lambda: resident_bytes(backend.pool.buf))
        for name, doc in (("blocks", "KV pool blocks"), ("free", "free KV pool blocks"),
                          ("entries", "shared KV pool entries (prefix blocks, promoted modules)")):
            Gauge(f"promptcache_kv_pool_{name}", doc, registry=r).set_function(
                lambda n=name: backend.stats().get(n, 0))
        usage = Gauge("promptcache_store_bytes", "bytes of stored states per tier", ["tier"], registry=r)
        for tier in store.usage():
            usage.labels(tier).set_function(lambda t=tier: store.usage().get(t, 0))
        r.register(_PoolBlocks(backend.pool))
        if store.shared:
            r.register(_RemoteCounters(store))

    def count_prompt(self, counts: TokenCounts) -> None:
        self.prompt_tokens.inc(counts.prompt)
        self.cached_tokens.inc(counts.cached)
        self.recomputed_tokens.inc(counts.recomputed)
        self.new_tokens.inc(counts.new)

    def render(self) -> bytes:
        return generate_latest(self.registry)


def _mincore():
    name = ctypes.util.find_library("c")
    try:
        fn = ctypes.CDLL(name, use_errno=True).mincore if name else None
    except (OSError, AttributeError):
        return None
    if fn is not None:
        fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    return fn


_MINCORE = _mincore()


def resident_bytes(t) -> int:
    """Bytes of a CPU tensor's memory resident now (``mincore``, page by page); -1 on a GPU or
    where there is no ``mincore``. A large buffer allocated untouched (the CPU KV pool) becomes
    resident page by page as it is written, so its size says nothing of what it costs."""
    if t.device.type != "cpu" or _MINCORE is None or t.numel() == 0:
        return -1
    page, addr = mmap.PAGESIZE, t.data_ptr()
    start = addr - addr % page
    pages = -(-(addr + t.numel() * t.element_size() - start) // page)
    vec = (ctypes.c_ubyte * pages)()
    if _MINCORE(start, pages * page, vec) != 0:
        return -1
    return (pages - bytes(vec).count(0)) * page


BLOCK_STATES = ("free", "request", "shared", "pinned", "idle")


def block_states(snapshot: dict) -> dict[str, int]:
    """KV pool blocks per state from ``KVPool.describe()``: free; request (a running request's
    own); shared (an entry requests read now); pinned (an entry no request reads, kept by a
    ``cache_control`` pin); idle (an entry no request reads, that eviction may take)."""
    counts = dict.fromkeys(BLOCK_STATES, 0)
    for state in snapshot["state"]:
        if state in ("free", "request"):
            counts[state] += 1
    for e in snapshot["entries"]:
        counts["shared" if e["refs"] else "pinned" if e["pinned"] else "idle"] += len(e["blocks"])
    return counts


class _PoolBlocks:
    """``promptcache_kv_pool_blocks_by_state{state}``: one pool snapshot per scrape."""

    def __init__(self, pool):
        self.pool = pool

    def collect(self):
        family = GaugeMetricFamily("promptcache_kv_pool_blocks_by_state", "KV pool blocks by state: free, request "
                                   "(a running request's own), shared (read by running requests), pinned (kept by "
                                   "cache_control), idle (cached, evictable)", labels=["state"])
        for state, n in block_states(self.pool.describe()).items():
            family.add_metric([state], n)
        yield family


class _RemoteCounters:
    """Counters read from the shared tier at each scrape (the tier counts; nothing to increment here)."""

    def __init__(self, store):
        self.store = store

    def collect(self):
        stats = self.store.shared_stats()
        for field, (name, doc) in REMOTE.items():
            yield CounterMetricFamily(name, doc, value=stats.get(field, 0))
