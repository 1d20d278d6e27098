"""The remote tier: module states shared by every replica through one Redis (or Valkey).

Layout in Redis of one state with content key K (``keys.py``; it already hashes the namespace,
model and tokenizer fingerprints, tokens and positions), format version ``v1``:

    pc:v1:{K}:0 .. pc:v1:{K}:<n-1>   the encoded value in chunks of ``chunk_bytes`` (last one shorter)
    pc:v1:{K}:h                      header, JSON {"chunks": n, "bytes": total, "sha256": of the value}
    pc:v1:{K}:lock                   single-flight encoding lock (``encode_lock``)

Writes: the chunks go in one pipeline; the header is written LAST, only after every chunk was
acknowledged, so a reader that finds a header never sees a half-written value. Reads check the
header (length and sha256 over the value) and the value's own metadata (content key, dtype,
shape, sha256 of the tensor data); a bad, truncated or partly evicted value is deleted and
reported as a miss, never returned.

``{K}`` is a Redis Cluster hash tag: only the text in braces is hashed to pick the key's slot,
so the chunks, header and lock of one state live on one shard. One pipeline then reads or writes
the whole state on one node, the header-last rule holds (it could not on two nodes that fail
separately), and the lock guards keys on its own node. Different states still spread over all
shards by their keys.

Failures never reach the caller: Redis down, slow (socket timeouts) or full (OOM on write) is
a logged warning (once per outage), a count in ``stats``, a miss for ``get`` and a dropped
write for ``put``. After a connection failure the tier stays quiet for a back-off (doubling
from ``retry_after[0]`` to ``retry_after[1]`` seconds), then the client reconnects by itself.
Eviction is Redis's (``maxmemory-policy allkeys-lru``, optional ``ttl``); this tier has no
budget and never picks a victim.

One file of ~320 lines on purpose: key layout, verification, failure handling and the lock are
one protocol over Redis and read best together; the two codec functions at the top are meant to
be replaced by the store's codec.
"""

from __future__ import annotations

import hashlib
import json
import logging
import struct
import threading
import time
import uuid
from contextlib import contextmanager
from typing import Callable, Iterator
from urllib.parse import urlsplit

import redis
import torch
from redis.backoff import NoBackoff
from redis.retry import Retry
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from .base import Tier

log = logging.getLogger(__name__)

PREFIX = "pc:v1"  # key prefix and value format version; bump it when the value layout changes


# -- the value codec (swap in the store's codec here) ---------------------------------------------
def encode_state(key: str, kv: torch.Tensor) -> bytes:
    """safetensors bytes of one state, metadata: content key, dtype, shape, sha256 of the data."""
    kv = kv.detach().contiguous().cpu()
    meta = {"key": key, "dtype": str(kv.dtype).removeprefix("torch."), "shape": json.dumps(list(kv.shape)),
            "sha256": _data_sha256(kv)}
    return st_save({"kv": kv}, metadata=meta)


def decode_state(key: str, value: bytes, check_data: bool = True) -> torch.Tensor:
    """The state in ``value`` (from ``encode_state``); ValueError naming the mismatch.
    ``check_data=False`` skips hashing the data, for a caller that already verified every byte
    of ``value`` against a checksum (the Redis header's): one sha256 pass instead of two."""
    if len(value) < 8:
        raise ValueError(f"value of {len(value)} bytes is no safetensors file")
    (n,) = struct.unpack("<Q", value[:8])
    try:
        meta = json.loads(value[8 : 8 + n])["__metadata__"]
        kv = st_load(value)["kv"]
    except Exception as e:  # truncated or not safetensors
        raise ValueError(f"unreadable value: {e}") from None
    if meta.get("key") != key:
        raise ValueError(f"value holds key {str(meta.get('key'))[:16]}..., asked for {key[:16]}...")
    got = (str(kv.dtype).removeprefix("torch."), json.dumps(list(kv.shape)),
           _data_sha256(kv) if check_data else meta.get("sha256"))
    want = (meta.get("dtype"), meta.get("shape"), meta.get("sha256"))
    bad = [f"{name} {g} (metadata: {w})" for name, g, w in zip(("dtype", "shape", "data sha256"), got, want) if g != w]
    if bad:
        raise ValueError(f"value does not match its metadata: {'; '.join(bad)}")
    return kv


def _data_sha256(t: torch.Tensor) -> str:
    return hashlib.sha256(t.reshape(-1).view(torch.uint8).numpy().data if t.numel() else b"").hexdigest()


# -- the tier -------------------------------------------------------------------------------------
_LUA_RELEASE = "if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('del', KEYS[1]) end return 0"
_FAILED = object()  # what _call returns when Redis failed or is in back-off


class RedisTier(Tier):
    """States in one Redis/Valkey shared by every process pointed at it (``name == "remote"``).

    ``url``: ``redis://[:password@]host:port/db`` (``rediss://`` for TLS). ``ttl``: seconds a
    stored state lives (None: until Redis evicts it). Timeouts are seconds; ``retry_after`` is
    the back-off (first, longest) after a connection failure. Thread-safe.
    """

    name = "remote"
    budget = None  # Redis's maxmemory and eviction policy bound it, not this process

    def __init__(self, url: str, chunk_bytes: int = 8 << 20, ttl: float | None = None,
                 connect_timeout: float = 0.5, timeout: float = 2.0,
                 retry_after: tuple[float, float] = (1.0, 5.0), poll: float = 0.05):
        if chunk_bytes < 1 or (ttl is not None and ttl <= 0) or connect_timeout <= 0 or timeout <= 0:
            raise ValueError(f"RedisTier: chunk_bytes, ttl, connect_timeout and timeout must be > 0, got "
                             f"{chunk_bytes}, {ttl}, {connect_timeout}, {timeout}")
        if not 0 < retry_after[0] <= retry_after[1]:
            raise ValueError(f"RedisTier: retry_after must be (first, longest) with 0 < first <= longest, "
                             f"got {retry_after}")
        parts = urlsplit(url)
        if parts.scheme not in ("redis", "rediss", "valkey", "valkeys"):
            raise ValueError(f"RedisTier: URL must look like redis://[:password@]host:port/db, got scheme "
                             f"'{parts.scheme}'")
        self.where = f"{parts.scheme}://{parts.hostname}:{parts.port or 6379}{parts.path or '/0'}"  # no password
        self.chunk_bytes, self.poll, self.retry_after = chunk_bytes, poll, retry_after
        self._ttl_ms = None if ttl is None else int(ttl * 1000)
        url = url.replace("valkey", "redis", 1) if parts.scheme.startswith("valkey") else url
        self._r = redis.Redis.from_url(url, socket_connect_timeout=connect_timeout, socket_timeout=timeout,
                                       retry=Retry(NoBackoff(), 0), health_check_interval=0)
        self._release = self._r.register_script(_LUA_RELEASE)
        self.stats = {"hits": 0, "misses": 0, "errors": 0, "bytes_in": 0, "bytes_out": 0, "corrupt": 0}
        self._lock = threading.Lock()
        self._down_until = 0.0  # time.monotonic() before which Redis is not tried
        self._backoff = retry_after[0]
        self._warned: set[str] = set()  # failure kinds warned about during the current outage

    # -- the Tier interface -----------------------------------------------------------------------
    def get(self, key: str) -> torch.Tensor | None:
        """The verified state, or None (absent, bad, or Redis unavailable)."""
        kv = self._call(lambda r: self._read(r, key), "read")
        hit = isinstance(kv, torch.Tensor)
        self._count("hits" if hit else "misses")
        return kv if hit else None

    def put(self, key: str, kv: torch.Tensor) -> None:
        """Publish a state (a no-op when Redis already holds it or is unavailable)."""
        if self._call(lambda r: bool(r.exists(self._k(key, "h"))), "probe") is not False:
            return  # there already (content-addressed: the same state), or Redis unavailable
        value = encode_state(key, kv)
        if self._call(lambda r: self._write(r, key, value), "write") is True:
            self._count("bytes_out", len(value))

    def evict(self, key: str) -> torch.Tensor | None:
        """Delete the state from Redis (for every replica); never returns a state."""
        self._call(lambda r: self._delete(r, key), "delete")
        return None

    def lru(self) -> str | None:
        return None  # Redis evicts by itself (maxmemory-policy)

    @property
    def bytes_used(self) -> int:
        return 0  # Redis's memory is not this process's budget; see stats for bytes moved

    def __contains__(self, key: str) -> bool:
        """Whether Redis holds a header for ``key`` (unverified: ``get`` verifies)."""
        return self._call(lambda r: bool(r.exists(self._k(key, "h"))), "read") is True

    def check(self, key: str) -> bool:
        """Read and verify the whole value; a bad one is deleted."""
        return self.get(key) is not None

    @contextmanager
    def encode_lock(self, key: str, ttl: float = 30.0) -> Iterator[bool]:
        """Single flight across processes: yields True when this process should encode ``key``
        (and publish it with ``put`` inside the block), False when another process published it
        meanwhile (``get`` it; a miss still means encode). A waiter polls for at most ``ttl``
        seconds; the lock expires after ``ttl``, so a crashed holder blocks nobody for longer.
        With Redis unavailable it yields True at once."""
        lock_key, token = self._k(key, "lock"), uuid.uuid4().hex
        mine = self._wait_turn(key, lock_key, token, ttl)
        try:
            yield mine
        finally:
            if mine:
                self._call(lambda r: self._release(keys=[lock_key], args=[token], client=r), "unlock")

    def close(self) -> None:
        """Close this tier's connections (a later call reconnects)."""
        self._r.close()

    # -- Redis operations (may raise; _call turns failures into misses) ---------------------------
    def _k(self, key: str, part: str | int) -> str:
        return f"{PREFIX}:{{{key}}}:{part}"  # {key}: Redis Cluster hash tag, one shard per state

    def _read(self, r: redis.Redis, key: str) -> torch.Tensor | None:
        raw = r.get(self._k(key, "h"))
        if raw is None:
            return None
        try:
            head = json.loads(raw)
            n, total, sha = int(head["chunks"]), int(head["bytes"]), str(head["sha256"])
        except (ValueError, KeyError, TypeError):
            return self._corrupt(r, key, "unreadable header")
        pipe = r.pipeline(transaction=False)
        for i in range(n):
            pipe.get(self._k(key, i))
        chunks = pipe.execute()
        if any(c is None for c in chunks):
            return self._corrupt(r, key, f"{sum(c is None for c in chunks)} of {n} chunks missing", n)
        value = b"".join(chunks)
        if len(value) != total:
            return self._corrupt(r, key, f"{len(value)} bytes, header says {total}", n)
        if hashlib.sha256(value).hexdigest() != sha:
            return self._corrupt(r, key, "sha256 mismatch", n)
        try:
            kv = decode_state(key, value, check_data=False)  # every byte matched the header's sha256
        except ValueError as e:
            return self._corrupt(r, key, str(e), n)
        self._count("bytes_in", total)
        return kv

    def _write(self, r: redis.Redis, key: str, value: bytes) -> bool:
        head_key = self._k(key, "h")
        view, size = memoryview(value), self.chunk_bytes
        n = max(1, -(-len(value) // size))
        # chunks outlive the header by a margin, so a live header never points at expired chunks
        chunk_px = None if self._ttl_ms is None else self._ttl_ms + 60_000
        pipe = r.pipeline(transaction=False)
        for i in range(n):
            pipe.set(self._k(key, i), view[i * size : (i + 1) * size], px=chunk_px)
        try:
            pipe.execute()
            head = json.dumps({"chunks": n, "bytes": len(value), "sha256": hashlib.sha256(value).hexdigest()})
            r.set(head_key, head, px=self._ttl_ms)  # last: the value is complete from here on
        except redis.exceptions.ResponseError:  # e.g. OOM: drop the chunks written so far
            r.delete(*[self._k(key, i) for i in range(n)])
            raise
        return True

    def _delete(self, r: redis.Redis, key: str, n: int | None = None) -> None:
        """Header first (no reader trusts the chunks from then on), then chunks 0..n-1; with n
        unknown (bad header), the header's count or runs of 16 until a run is incomplete."""
        head = r.get(self._k(key, "h")) if n is None else None
        r.delete(self._k(key, "h"))
        try:
            n = int(json.loads(head)["chunks"]) if head is not None else n
        except (ValueError, KeyError, TypeError):
            n = None
        if n is not None:
            r.delete(*[self._k(key, i) for i in range(max(n, 1))])
            return
        start = 0
        while r.delete(*[self._k(key, i) for i in range(start, start + 16)]) == 16:
            start += 16

    def _corrupt(self, r: redis.Redis, key: str, why: str, n: int | None = None) -> None:
        log.warning("shared tier %s: bad value for %s... (%s): deleted, treated as a miss", self.where,
                    key[:16], why)
        self._count("corrupt")
        self._delete(r, key, n)
        return None

    def _wait_turn(self, key: str, lock_key: str, token: str, ttl: float) -> bool:
        deadline = time.monotonic() + ttl
        while True:
            if self._call(lambda r: bool(r.exists(self._k(key, "h"))), "lock") is True:
                return False  # published by someone else
            got = self._call(lambda r: r.set(lock_key, token, nx=True, px=max(1, int(ttl * 1000))), "lock")
            if got is _FAILED or got:
                return True  # ours (or Redis unavailable: encode locally)
            if time.monotonic() >= deadline:
                log.warning("shared tier %s: waited %.1fs for another process to encode %s...; encoding here",
                            self.where, ttl, key[:16])
                return True
            time.sleep(self.poll)

    # -- failure handling -------------------------------------------------------------------------
    def _call(self, fn: Callable[[redis.Redis], object], what: str) -> object:
        """fn(client), or _FAILED when Redis is in back-off or the call failed (logged, counted)."""
        if time.monotonic() < self._down_until:
            return _FAILED
        try:
            out = fn(self._r)
        except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError, OSError) as e:
            self._failed("down", what, e, backoff=True)
            return _FAILED
        except redis.exceptions.RedisError as e:  # the server answered with an error: full, read-only, ...
            kind = "full" if isinstance(e, redis.exceptions.OutOfMemoryError) else type(e).__name__
            self._failed(kind, what, e, backoff=False)
            return _FAILED
        self._recovered(what)
        return out

    def _failed(self, kind: str, what: str, e: Exception, backoff: bool) -> None:
        with self._lock:
            self.stats["errors"] += 1
            first = kind not in self._warned
            self._warned.add(kind)
            wait = self._backoff if backoff else 0.0
            if backoff:
                self._down_until = time.monotonic() + wait
                self._backoff = min(self._backoff * 2, self.retry_after[1])
        if first:
            log.warning("shared tier %s unavailable (%s on %s: %s): serving from local states%s", self.where,
                        kind, what, e, f"; retrying in {wait:.1f}s" if backoff else "")
        else:
            log.debug("shared tier %s: %s on %s: %s", self.where, kind, what, e)

    def _recovered(self, what: str) -> None:
        if not self._warned or (what != "write" and self._warned == {"full"}):
            return  # nothing to clear (a full Redis is only cleared by a successful write)
        with self._lock:
            was, self._warned = self._warned, set()
            self._backoff, self._down_until = self.retry_after[0], 0.0
        log.info("shared tier %s reachable again (after %s)", self.where, ", ".join(sorted(was)))

    def _count(self, name: str, n: int = 1) -> None:
        with self._lock:
            self.stats[name] += n
