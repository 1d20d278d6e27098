"""resp.BulkConnection against a real redis-server: values land in the caller's buffer, in order,
with every range reported; nil, oversized values, error replies, AUTH, SELECT and unix sockets."""

from __future__ import annotations

import os

import pytest
import redis
import torch

from promptcache.store.remote import RedisTier
from promptcache.store.resp import BulkConnection, command, supports


def conn(url: str) -> BulkConnection:
    return BulkConnection(url, connect_timeout=1.0, timeout=2.0)


def test_values_land_in_one_buffer_in_order_with_every_range_reported(redis_server):
    client = redis_server.client()
    values = [os.urandom(n) for n in (3 << 20, 1, 70_000, 0, 5)]  # larger than any socket read, and tiny
    for i, v in enumerate(values):
        client.set(f"k{i}", v)
    c = conn(redis_server.url)
    buf = bytearray(sum(map(len, values)))
    ranges = []
    missing, size = c.get_into([f"k{i}" for i in range(len(values))], memoryview(buf),
                               lambda a, b: ranges.append((a, b)))
    assert (missing, size) == (0, len(buf)) and bytes(buf) == b"".join(values)
    assert ranges[0][0] == 0 and ranges[-1][1] == len(buf)
    assert all(b0 == a1 for (_, b0), (a1, _) in zip(ranges, ranges[1:])) and all(a < b for a, b in ranges)
    assert c.get("k2") == values[2] and c.get("nothing") is None  # the connection is still in step


def test_missing_and_oversized_values_are_reported_and_the_connection_stays_usable(redis_server):
    client = redis_server.client()
    client.set("a", b"x" * 10)
    client.set("big", b"y" * 100_000)
    c = conn(redis_server.url)
    buf = bytearray(20)
    assert c.get_into(["a", "gone", "big", "a"], memoryview(buf)) == (1, 100_020)
    assert bytes(buf[:10]) == b"x" * 10  # "big" did not fit: read and dropped, not written
    assert c.get("a") == b"x" * 10


def test_error_replies_raise_redis_errors(start_redis):
    server = start_redis(password="pw")
    with pytest.raises(redis.exceptions.AuthenticationError):
        conn(f"redis://127.0.0.1:{server.port}/0").get("k")  # no password: NOAUTH
    with pytest.raises(redis.exceptions.AuthenticationError):
        conn(f"redis://:wrong@127.0.0.1:{server.port}/0")
    server.client().rpush("list", "x")
    with pytest.raises(redis.exceptions.ResponseError, match="WRONGTYPE"):
        conn(server.url).get("list")


def test_select_reads_the_urls_database(redis_server):
    redis.Redis(port=redis_server.port, db=3).set("k", b"three")
    assert conn(redis_server.url.replace("/0", "/3")).get("k") == b"three"
    assert conn(redis_server.url).get("k") is None


def test_unix_socket_and_tier_over_it(start_redis, tmp_path):
    path = tmp_path / "redis.sock"
    server = start_redis(extra=("--unixsocket", str(path)))
    redis.Redis(port=server.port).set("k", b"v")
    assert conn(f"unix://{path}").get("k") == b"v"
    tier, kv = RedisTier(f"unix://{path}?db=2"), torch.randn(2, 2, 4, 30, 16)
    tier.put("ab" * 32, kv)
    assert torch.equal(tier.get("ab" * 32), kv) and tier.stats["errors"] == 0


def test_command_encoding_and_supported_urls():
    assert command("GET", b"k\r\n") == b"*2\r\n$3\r\nGET\r\n$3\r\nk\r\n\r\n"  # binary-safe: lengths, no escaping
    assert supports("redis://h:1/0") and supports("unix:///tmp/s") and not supports("rediss://h:1/0")
