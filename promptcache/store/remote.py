"""The remote tier: module states shared by every replica through one Redis (or Valkey).

A ``ByteTier``: values are the store's codec bytes (safetensors with the content key, dtype,
shape and a checksum over all of them and the data), verified on every fetch exactly like disk
states (``bytetier.py``). Layout in Redis of one state with content key K (``keys.py``; it
already hashes the namespace, model and tokenizer fingerprints, tokens and positions), format
version ``v2`` (the codec's format; values of another version are never read):

    pc:v2:{K}:0 .. pc:v2:{K}:<n-1>   the codec value in chunks of ``chunk_bytes`` (last one shorter)
    pc:v2:{K}:h                      header, JSON {"chunks": n, "bytes": total}
    pc:v2:{K}:lock                   single-flight encoding lock (``encode_lock``)

Writes: the chunks go in one pipeline; the header is written LAST, only after every chunk was
acknowledged, so a reader that finds a header never sees a half-written value. Reads take the
header, then every chunk in one pipeline, on a pooled connection of ``resp.py`` that receives
the chunks straight into one buffer of the header's size while ``codec.Digest`` hashes what has
arrived (no copies; the checksum pass overlaps the transfer); the state is a view of that buffer.
A missing chunk, a length that differs from the header's or a value the codec refuses is
deleted and reported as a miss, never returned.

``{K}`` is a Redis Cluster hash tag: only the text in braces is hashed to pick the key's slot,
so the chunks, header and lock of one state live on one shard. One pipeline then reads or writes
the whole state on one node, the header-last rule holds (it could not on two nodes that fail
separately), and the lock guards keys on its own node. Different states still spread over all
shards by their keys.

Cluster mode (``redis+cluster://[:password@]host:port``, any node as the seed): the client is
redis-py's ``RedisCluster`` (it learns the slot map and follows MOVED), created on first use so a
cluster that is down at start is an outage like any other; direct reads go to the node that owns
the state's slot (one connection pool per node). A node that fails loses the states on it: their
reads fail or miss, they are encoded again and published to whichever node owns the slot by
then; the other nodes' states are still served, so a node failure does not put the whole tier
into back-off (the back-off is for a single Redis). The nodes need
``cluster-require-full-coverage no`` to go on answering while a shard is down.

Failures never reach the caller: Redis down, slow (socket timeouts) or full (OOM on write) is
a logged warning (once per outage), a count in ``stats``, a miss for ``get`` / ``exists`` and a
dropped write for ``put``. After a connection failure the tier stays quiet for a back-off
(doubling from ``retry_after[0]`` to ``retry_after[1]`` seconds), then the client reconnects by
itself. Eviction is Redis's (``maxmemory-policy allkeys-lru``, optional ``ttl``).

Over 300 lines on purpose: key layout, reads, failure handling and the lock are one protocol
over Redis and read best together (the wire format of direct reads is ``resp.py``'s).
"""

from __future__ import annotations

import json
import logging
import threading
import time
import uuid
from contextlib import contextmanager
from typing import Callable, Iterable, Iterator
from urllib.parse import urlsplit

import redis
import torch
from redis.backoff import NoBackoff
from redis.retry import Retry

from .. import jsonsafe
from . import codec
from .bytetier import ByteTier
from .resp import BulkConnection, supports

log = logging.getLogger(__name__)

PREFIX = "pc:v2"  # key prefix and value format version; bump it when the value layout changes
CLUSTER_SCHEMES = ("redis+cluster", "rediss+cluster")
SCHEMES = ("redis", "rediss", "unix", "valkey", "valkeys", *CLUSTER_SCHEMES)

_LUA_RELEASE = "if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('del', KEYS[1]) end return 0"
_FAILED = object()  # what _call returns when Redis failed or is in back-off
MAX_CHUNK = 512 << 20  # Redis's largest string (proto-max-bulk-len): a header claiming more per chunk lies


class RedisTier(ByteTier):
    """States in one Redis/Valkey shared by every process pointed at it (``name == "remote"``).

    ``url``: ``redis://[:password@]host:port/db`` (``rediss://`` for TLS, ``unix://`` for a
    socket). ``write_policy``: ``"through"`` (publish every new state) or ``"on_evict"``
    (publish what this process's memory tiers evict). ``ttl``: seconds a stored state lives
    (None: until Redis evicts it). ``lock_ttl``: expiry of the encoding lock, and how long a
    waiter waits for another process's encoding. Timeouts are seconds; ``retry_after`` is the
    back-off (first, longest) after a connection failure. ``direct_reads``: values are read by
    ``resp.BulkConnection`` straight into their final buffer (False, or a TLS URL: through
    redis-py, one more copy per chunk). Thread-safe.
    """

    def __init__(self, url: str, write_policy: str = "through", chunk_bytes: int = 8 << 20,
                 ttl: float | None = None, lock_ttl: float = 60.0, connect_timeout: float = 0.5,
                 timeout: float = 2.0, retry_after: tuple[float, float] = (1.0, 5.0), poll: float = 0.05,
                 direct_reads: bool = True):
        super().__init__("remote", write_policy)
        if chunk_bytes < 1 or (ttl is not None and ttl <= 0) or lock_ttl <= 0 or connect_timeout <= 0 or timeout <= 0:
            raise ValueError(f"RedisTier: chunk_bytes, ttl, lock_ttl, connect_timeout and timeout must be > 0, got "
                             f"{chunk_bytes}, {ttl}, {lock_ttl}, {connect_timeout}, {timeout}")
        if not 0 < retry_after[0] <= retry_after[1]:
            raise ValueError(f"RedisTier: retry_after must be (first, longest) with 0 < first <= longest, "
                             f"got {retry_after}")
        parts = urlsplit(url)
        if parts.scheme not in SCHEMES:
            raise ValueError(f"RedisTier: URL must look like redis://[:password@]host:port/db, got scheme "
                             f"'{parts.scheme}'")
        self.where = (f"unix://{parts.path}" if parts.scheme == "unix" else  # never the password
                      f"{parts.scheme}://{parts.hostname}:{parts.port or 6379}{parts.path or '/0'}")
        self.chunk_bytes, self.lock_ttl, self.poll, self.retry_after = chunk_bytes, lock_ttl, poll, retry_after
        self._ttl_ms = None if ttl is None else int(ttl * 1000)
        url = url.replace("valkey", "redis", 1) if parts.scheme.startswith("valkey") else url
        self.cluster = parts.scheme in CLUSTER_SCHEMES
        url = url.replace("+cluster", "", 1) if self.cluster else url
        self._url, self._timeouts, self._bulk = url, (connect_timeout, timeout), direct_reads and supports(url)
        self._client: redis.Redis | None = None if self.cluster else self._connect()  # cluster: on first use
        self._pools: dict[str, list[BulkConnection]] = {}  # node address -> idle read connections (resp.py)
        self._lock = threading.Lock()
        self._down_until = 0.0  # time.monotonic() before which Redis is not tried
        self._backoff = retry_after[0]
        self._warned: set[str] = set()  # failure kinds warned about during the current outage

    # -- the ByteTier interface -------------------------------------------------------------------
    def read(self, key: str) -> torch.Tensor | None:
        got = self.read_hashed(key, None)
        return None if got is None else got[0]

    def read_hashed(self, key: str, name: str | None) -> tuple[torch.Tensor, codec.Digest | None] | None:
        value = self._call(lambda r: self._read(r, key, name), "read")
        if isinstance(value, str):  # what is wrong with the stored value
            self.bad_value(key, value)
        return value if isinstance(value, tuple) else None

    def write(self, key: str, value: bytes) -> bool:
        return self._call(lambda r: self._write(r, key, value), "write") is True

    def delete(self, key: str) -> None:
        self._call(lambda r: self._delete(r, key), "delete")

    def exists(self, key: str) -> bool:
        return self._call(lambda r: bool(r.exists(self._k(key, "h"))), "probe") is True

    def exists_many(self, keys: Iterable[str]) -> set[str]:
        """One pipelined round trip for every key (none when Redis is unavailable). A cluster: one
        probe per key, so a dead node hides only its own states (a cluster pipeline fails whole)."""
        keys = list(keys)
        if not keys:
            return set()
        if self.cluster:
            return {k for k in keys if self.exists(k)}

        def probe(r: redis.Redis) -> list:
            pipe = r.pipeline(transaction=False)
            for k in keys:
                pipe.exists(self._k(k, "h"))
            return pipe.execute()

        found = self._call(probe, "probe")
        return set() if found is _FAILED else {k for k, n in zip(keys, found) if n}

    def check(self, key: str) -> bool:
        """Read and verify the whole value; a bad one is deleted."""
        return self.get(key) is not None

    @contextmanager
    def encode_lock(self, key: str, ttl: float | None = None) -> Iterator[bool]:
        """Single flight across processes: yields True when this process should encode ``key``
        (and publish it with ``put`` inside the block), False when another process published it
        meanwhile (``get`` it; a miss still means encode). A waiter polls for at most ``ttl``
        seconds (default ``lock_ttl``); the lock expires after ``ttl``, so a crashed holder blocks
        nobody for longer. With Redis unavailable it yields True at once."""
        ttl = self.lock_ttl if ttl is None else ttl
        lock_key, token = self._k(key, "lock"), uuid.uuid4().hex
        mine = self._wait_turn(key, lock_key, token, ttl)
        try:
            yield mine
        finally:
            if mine:
                self._call(lambda r: r.eval(_LUA_RELEASE, 1, lock_key, token), "unlock")

    def close(self) -> None:
        """Close this tier's connections (a later call reconnects)."""
        if self._client is not None:
            self._client.close()
        with self._lock:
            pools, self._pools = self._pools, {}
        for conn in (c for pool in pools.values() for c in pool):
            conn.close()

    def _connect(self) -> redis.Redis:
        connect_timeout, timeout = self._timeouts
        if self.cluster:
            from redis.cluster import RedisCluster

            return RedisCluster.from_url(self._url, socket_connect_timeout=connect_timeout, socket_timeout=timeout,
                                         retry=Retry(NoBackoff(), 0), health_check_interval=0)
        return redis.Redis.from_url(self._url, socket_connect_timeout=connect_timeout, socket_timeout=timeout,
                                    retry=Retry(NoBackoff(), 0), health_check_interval=0)

    def _redis(self) -> redis.Redis:
        """The client (a cluster's is created here, on first use: connecting may raise)."""
        if self._client is None:
            with self._lock:
                if self._client is None:
                    self._client = self._connect()
        return self._client

    # -- Redis operations (may raise; _call turns failures into misses) ---------------------------
    def _k(self, key: str, part: str | int) -> str:
        return f"{PREFIX}:{{{key}}}:{part}"  # {key}: Redis Cluster hash tag, one shard per state

    def _read(self, r: redis.Redis, key: str, name: str | None) -> tuple | str | None:
        """(value as a uint8 tensor, Digest of state ``name`` or None), None when absent, or what
        is wrong with the value (a str). The chunks land in one buffer, hashed as they arrive."""
        node = self._node_url(r, key) if self._bulk else None
        conn = self._take(node) if node is not None else None
        try:
            out = self._fetch(r, conn, key, name)
        except BaseException:
            if conn is not None:
                conn.close()
            raise
        if conn is not None:
            with self._lock:
                self._pools.setdefault(node, []).append(conn)
        return out

    def _node_url(self, r: redis.Redis, key: str) -> str:
        """The URL of the server holding ``key``'s state: the one Redis, or the cluster node that
        owns its slot (the password kept, the host and port that node's)."""
        if not self.cluster:
            return self._url
        node = r.get_node_from_key(self._k(key, "h"))
        parts = urlsplit(self._url)
        auth = parts.netloc.rsplit("@", 1)[0] + "@" if "@" in parts.netloc else ""
        return f"{parts.scheme}://{auth}{node.host}:{node.port}/0"

    def _fetch(self, r: redis.Redis, conn: BulkConnection | None, key: str, name: str | None) -> tuple | str | None:
        raw = conn.get(self._k(key, "h")) if conn is not None else r.get(self._k(key, "h"))
        if raw is None:
            return None
        try:
            head = jsonsafe.loads(raw)
            n, total = int(head["chunks"]), int(head["bytes"])
            if n < 1 or total < 0 or total > n * MAX_CHUNK:
                raise ValueError
            buf = torch.empty(total, dtype=torch.uint8)
        except (ValueError, KeyError, TypeError, RuntimeError):  # RuntimeError: no memory for that size
            return "unreadable header"
        view = memoryview(buf.numpy()) if total else memoryview(bytearray())
        digest = codec.Digest(view, name) if name is not None else None
        keys = [self._k(key, i) for i in range(n)]
        on_data = digest.update if digest is not None else None
        if conn is not None:
            missing, size = conn.get_into(keys, view, on_data)
        else:  # TLS: through redis-py, one copy per chunk into the buffer
            missing, size = 0, 0
            for chunk in _pipelined_gets(r, keys):
                if chunk is None:
                    missing += 1
                    continue
                if size + len(chunk) <= total:
                    view[size : size + len(chunk)] = chunk
                    if on_data is not None:
                        on_data(size, size + len(chunk))
                size += len(chunk)
        if missing:
            return f"{missing} of {n} chunks missing"
        if size != total:
            return f"{size} bytes, header says {total}"
        return buf, digest  # the codec verifies it (ByteTier.get)

    def _take(self, url: str) -> BulkConnection:
        with self._lock:
            pool = self._pools.get(url)
            if pool:
                return pool.pop()
        return BulkConnection(url, self._timeouts[0], self._timeouts[1])

    def _write(self, r: redis.Redis, key: str, value: bytes) -> bool:
        view, size = memoryview(value), self.chunk_bytes
        n = max(1, -(-len(value) // size))
        # chunks outlive the header by a margin, so a live header never points at expired chunks
        chunk_px = None if self._ttl_ms is None else self._ttl_ms + 60_000
        pipe = r.pipeline(transaction=False)
        for i in range(n):
            pipe.set(self._k(key, i), view[i * size : (i + 1) * size], px=chunk_px)
        try:
            pipe.execute()
            r.set(self._k(key, "h"), json.dumps({"chunks": n, "bytes": len(value)}), px=self._ttl_ms)  # last
        except redis.exceptions.ResponseError:  # e.g. OOM: drop the chunks written so far
            r.delete(*[self._k(key, i) for i in range(n)])
            raise
        return True

    def _delete(self, r: redis.Redis, key: str) -> None:
        """Header first (no reader trusts the chunks from then on), then chunks 0..n-1 by the
        header's count or, without a readable header, runs of 16 until a run is incomplete."""
        head = r.get(self._k(key, "h"))
        r.delete(self._k(key, "h"))
        try:
            n = int(jsonsafe.loads(head)["chunks"]) if head is not None else None
        except (ValueError, KeyError, TypeError):
            n = None
        if n is not None:
            r.delete(*[self._k(key, i) for i in range(max(n, 1))])
            return
        start = 0
        while r.delete(*[self._k(key, i) for i in range(start, start + 16)]) == 16:
            start += 16

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
            out = fn(self._redis())
        except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError, OSError,
                redis.exceptions.RedisClusterException) as e:  # the last: no node reachable, a slot unserved
            self._failed("down", what, e, backoff=not self.cluster)  # a cluster: one node down, not all
            return _FAILED
        except redis.exceptions.RedisError as e:  # the server answered with an error: full, read-only, ...
            kind = "full" if isinstance(e, redis.exceptions.OutOfMemoryError) else type(e).__name__
            self._failed(kind, what, e, backoff=False)
            return _FAILED
        self._recovered(what)
        return out

    def _failed(self, kind: str, what: str, e: Exception, backoff: bool) -> None:
        self.count("errors")
        with self._lock:
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


def _pipelined_gets(r: redis.Redis, keys: list[str]) -> list[bytes | None]:
    pipe = r.pipeline(transaction=False)
    for k in keys:
        pipe.get(k)
    return pipe.execute()
