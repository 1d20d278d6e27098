"""Bulk reads from Redis straight into the caller's memory: a minimal RESP2 client for GET only.

redis-py's reply parser copies every value several times (socket -> its buffer -> a bytes object,
then the caller joins the chunks): for a state of hundreds of MiB that costs more than the network
does. ``BulkConnection`` sends pipelined GETs on its own socket and ``recv_into``s each value at
its place in one buffer the caller allocated, so the bytes are copied once, by the kernel.
``on_data(start, end)`` is told as each range lands (the codec hashes it while the next arrives).

Only what a read needs: TCP or unix socket, AUTH (user and password), SELECT, GET; RESP2 (the
protocol a connection speaks unless it sends HELLO). TLS URLs (``rediss://``) are not handled
here (``supports``): the caller uses redis-py for them. Errors are the ones redis-py raises for
the same failures, so a caller handles both alike: ``OSError`` / ``socket.timeout`` for the
network, ``redis.exceptions.AuthenticationError`` for a refused password, ``ResponseError`` for
any other error reply. After any error the connection is unusable: ``close`` it.
"""

from __future__ import annotations

import socket
from typing import Callable, Sequence

import redis
from redis.connection import parse_url

_CRLF = b"\r\n"
_READ = 1 << 16  # bytes asked of the socket when reading reply lines
_AUTH_ERRORS = ("NOAUTH", "WRONGPASS", "NOPERM", "ERR AUTH", "ERR invalid password", "ERR Client sent AUTH")


def supports(url: str) -> bool:
    """Whether ``BulkConnection`` can talk to ``url`` (plain TCP or a unix socket, not TLS)."""
    return url.split(":", 1)[0] in ("redis", "unix", "valkey")


def command(*args: str | bytes) -> bytes:
    """One command in RESP (an array of bulk strings)."""
    out = [b"*%d\r\n" % len(args)]
    for a in args:
        b = a.encode() if isinstance(a, str) else a
        out += [b"$%d\r\n" % len(b), b, _CRLF]
    return b"".join(out)


class BulkConnection:
    """One connection to the Redis of ``url`` (``redis://`` or ``unix://``); not thread-safe
    (a caller keeps a pool). ``connect_timeout`` / ``timeout`` in seconds, as for redis-py."""

    def __init__(self, url: str, connect_timeout: float, timeout: float):
        params = parse_url(url.replace("valkey", "redis", 1) if url.startswith("valkey") else url)
        if "path" in params:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.settimeout(connect_timeout)
            try:
                sock.connect(params["path"])
            except BaseException:
                sock.close()
                raise
        else:
            sock = socket.create_connection((params.get("host", "localhost"), params.get("port", 6379)),
                                            timeout=connect_timeout)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.settimeout(timeout)
        self.sock, self._pending, self._scratch = sock, bytearray(), None
        try:
            setup = []
            if params.get("password") is not None:
                user = params.get("username")
                setup.append(command("AUTH", *((user,) if user else ()), params["password"]))
            if int(params.get("db") or 0):
                setup.append(command("SELECT", str(int(params["db"]))))
            if setup:
                sock.sendall(b"".join(setup))
                for _ in setup:
                    self._line()  # +OK, or an error reply raised
        except BaseException:
            self.close()
            raise

    def get(self, key: str) -> bytes | None:
        """GET: the value, or None when the key does not exist."""
        self.sock.sendall(command("GET", key))
        n = self._length()
        if n < 0:
            return None
        buf = bytearray(n)
        self._bulk_into(memoryview(buf), n)
        return bytes(buf)

    def get_into(self, keys: Sequence[str], view: memoryview,
                 on_data: Callable[[int, int], None] | None = None) -> tuple[int, int]:
        """Pipelined GETs of ``keys``; their values are written one after another into ``view``
        (bytes), ``on_data(start, end)`` called as each range of it is filled. Returns (values
        missing, total length of the values present). Values that would run past the end of
        ``view`` are read and dropped (the total then exceeds ``len(view)``)."""
        self.sock.sendall(b"".join(command("GET", k) for k in keys))
        missing, pos = 0, 0
        for _ in keys:
            n = self._length()
            if n < 0:
                missing += 1
                continue
            if pos + n <= len(view):
                self._bulk_into(view[pos : pos + n], n, on_data, pos)
            else:
                self._drop(n)
            pos += n
        return missing, pos

    def close(self) -> None:
        self.sock.close()

    # -- RESP2 replies ----------------------------------------------------------------------------
    def _line(self) -> bytes:
        """One reply line without its CRLF; an error reply raises."""
        while (end := self._pending.find(_CRLF)) < 0:
            self._pending += self._recv()
        line = bytes(self._pending[:end])
        del self._pending[: end + 2]
        if line[:1] == b"-":
            msg = line[1:].decode(errors="replace")
            if msg.startswith(_AUTH_ERRORS):
                raise redis.exceptions.AuthenticationError(msg)
            raise redis.exceptions.ResponseError(msg)
        return line

    def _length(self) -> int:
        """The length of the next bulk reply (-1: nil)."""
        line = self._line()
        if line[:1] != b"$":
            raise redis.exceptions.ResponseError(f"expected a bulk string reply, got {line[:40]!r}")
        return int(line[1:])

    def _bulk_into(self, view: memoryview, n: int, on_data=None, at: int = 0) -> None:
        """The next n bytes (a bulk reply's data) into view[:n], then its CRLF."""
        have = min(len(self._pending), n)
        view[:have] = self._pending[:have]
        del self._pending[:have]
        pos = have
        if on_data is not None and have:
            on_data(at, at + have)
        while pos < n:
            got = self.sock.recv_into(view[pos:n], n - pos)
            if not got:
                raise redis.exceptions.ConnectionError("Redis closed the connection mid-reply")
            if on_data is not None:
                on_data(at + pos, at + pos + got)
            pos += got
        self._crlf()

    def _drop(self, n: int) -> None:
        """Read and discard a bulk reply's n bytes and its CRLF."""
        have = min(len(self._pending), n)
        del self._pending[:have]
        self._scratch = self._scratch or memoryview(bytearray(_READ))
        while have < n:
            got = self.sock.recv_into(self._scratch, min(_READ, n - have))
            if not got:
                raise redis.exceptions.ConnectionError("Redis closed the connection mid-reply")
            have += got
        self._crlf()

    def _crlf(self) -> None:
        while len(self._pending) < 2:
            self._pending += self._recv()
        if self._pending[:2] != _CRLF:
            raise redis.exceptions.ResponseError("malformed bulk reply (no CRLF after the data)")
        del self._pending[:2]

    def _recv(self) -> bytes:
        data = self.sock.recv(_READ)
        if not data:
            raise redis.exceptions.ConnectionError("Redis closed the connection")
        return data
