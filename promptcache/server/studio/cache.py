"""The studio's cache view: what the KV pool and the store hold, as one namespace may see it.

Tenancy. Content keys are hashes salted with the namespace (``keys.py``), so the pool cannot say
whose an entry is. The view attributes keys it can derive for the caller's namespace: its
schemas' module states (``EncodedSchema.keys``) and the prefix blocks of its own recent plain
chat and completion requests (recorded by ``Traffic``; their block keys are derived when a view
asks, from the same token ids the preparer made). Those entries are listed with names, text and
where they are; every other block is drawn only by its state (free, a running request's,
shared, pinned, idle), never with a key, a name or text. Blocks of answers, Anthropic requests
and documents are not attributed (they show as not yours), except on a server without keys,
where every request is in the one namespace and every entry is the caller's.

Block codes (one character per pool block): ``.`` free, ``r`` a running request's own, ``s``
a shared entry being read, ``p`` an idle entry pinned by ``cache_control``, ``i`` an idle
entry; upper case (``S``, ``P``, ``I``) for entries attributed to the caller's namespace.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict, deque
from dataclasses import dataclass

WINDOW = 600.0  # seconds of request history kept per namespace (hit rates over time)
BUCKET = 10.0  # seconds per point of the hit-rate series
BODIES = 32  # recent request bodies per namespace whose prefix keys are derived on demand
KEYS = 8192  # attributed keys kept per namespace (least recently derived dropped first)


@dataclass
class Record:
    t: float  # time.time() when the answer finished
    prompt: int
    cached: int  # served from stored states (server/core/counts.py: recomputed tokens are not)
    recomputed: int
    ttft: float | None


TOTALS = ("requests", "prompt_tokens", "cached_tokens", "recomputed_tokens")


class Traffic:
    """Per namespace: recent requests' counts, totals, and the bodies of plain requests whose
    prefix blocks the cache view attributes to it. Thread-safe."""

    def __init__(self):
        self.lock = threading.Lock()
        self.records: dict[str, deque[Record]] = {}
        self.totals: dict[str, dict[str, int]] = {}
        self.bodies: dict[str, deque] = {}
        self.keys: dict[str, OrderedDict[str, str]] = {}  # namespace -> key -> label

    def record(self, ns: str, prompt: int, cached: int, ttft: float | None, body=None, recomputed: int = 0) -> None:
        """One answered request: its ``TokenCounts``' prompt, cached and recomputed tokens."""
        now = time.time()
        with self.lock:
            q = self.records.setdefault(ns, deque())
            q.append(Record(now, prompt, cached, recomputed, ttft))
            while q and q[0].t < now - WINDOW:
                q.popleft()
            tot = self.totals.setdefault(ns, dict.fromkeys(TOTALS, 0))
            tot["requests"] += 1
            tot["prompt_tokens"] += prompt
            tot["cached_tokens"] += cached
            tot["recomputed_tokens"] += recomputed
            if body is not None:
                self.bodies.setdefault(ns, deque(maxlen=BODIES)).append(body)

    def pending(self, ns: str) -> list:
        """The bodies recorded since the last call (their keys are derived once)."""
        with self.lock:
            q = self.bodies.get(ns)
            out = list(q) if q else []
            if q:
                q.clear()
            return out

    def attribute(self, ns: str, keys: dict[str, str]) -> None:
        with self.lock:
            own = self.keys.setdefault(ns, OrderedDict())
            for k, label in keys.items():
                own[k] = label
                own.move_to_end(k)
            while len(own) > KEYS:
                own.popitem(last=False)

    def attributed(self, ns: str) -> dict[str, str]:
        with self.lock:
            return dict(self.keys.get(ns, {}))

    def series(self, ns: str) -> list[dict]:
        """Points of ``BUCKET`` seconds over the last ``WINDOW``: requests, prompt, cached and
        recomputed tokens, hit rate (cached / prompt: recomputed tokens are not hits), mean TTFT (ms)."""
        now = time.time()
        with self.lock:
            recs = [r for r in self.records.get(ns, ()) if r.t >= now - WINDOW]
        points: dict[int, list[Record]] = {}
        for r in recs:
            points.setdefault(int((now - r.t) // BUCKET), []).append(r)
        out = []
        for age in sorted(points, reverse=True):
            rs = points[age]
            prompt, cached = sum(r.prompt for r in rs), sum(r.cached for r in rs)
            ttfts = [r.ttft for r in rs if r.ttft is not None]
            out.append({"age_s": age * BUCKET, "requests": len(rs), "prompt_tokens": prompt, "cached_tokens": cached,
                        "recomputed_tokens": sum(r.recomputed for r in rs),
                        "hit_rate": cached / prompt if prompt else 0.0,
                        "ttft_ms": 1e3 * sum(ttfts) / len(ttfts) if ttfts else None})
        return out

    def total(self, ns: str) -> dict[str, int]:
        with self.lock:
            return dict(self.totals.get(ns, dict.fromkeys(TOTALS, 0)))


UNNAMED = "(blocks of an answer, a document or an Anthropic request)"


def blocks(snapshot: dict, own: dict[str, str], all_own: bool = False) -> tuple[str, list[dict]]:
    """(one code per block, the caller's entries in the pool) from ``KVPool.describe()``;
    ``own``: key -> label of the caller's keys; ``all_own``: every entry is the caller's (a
    server without keys has one namespace), unnamed ones labelled ``UNNAMED``. No key leaves
    this function: others' entries become codes only."""
    codes = ["." if s == "free" else "r" for s in snapshot["state"]]
    mine = []
    for e in snapshot["entries"]:
        code = "s" if e["refs"] else ("p" if e["pinned"] else "i")
        is_mine = all_own or e["key"] in own
        for b in e["blocks"]:
            codes[b] = code.upper() if is_mine else code
        if is_mine:
            mine.append({"label": own.get(e["key"], UNNAMED), "tokens": e["tokens"], "blocks": len(e["blocks"]),
                         "first_block": min(e["blocks"]) if e["blocks"] else None, "refs": e["refs"],
                         "state": {"s": "shared", "p": "pinned", "i": "idle"}[code]})
    return "".join(codes), mine


def summary(codes: str) -> dict[str, int]:
    """Blocks per state (own and others' together)."""
    low = codes.lower()
    return {"blocks": len(codes), "free": low.count("."), "request": low.count("r"), "shared": low.count("s"),
            "pinned": low.count("p"), "idle": low.count("i"), "yours": sum(c.isupper() for c in codes)}
