"""RedisTier against a real redis-server: round trips, chunking, verification (the store's codec),
namespaces, password, lock."""

from __future__ import annotations

import json
import logging
import threading
import time

import pytest
import torch

from promptcache.keys import content_keys
from promptcache.layout import layout_schema
from promptcache.store import codec
from promptcache.store.remote import PREFIX, RedisTier
from promptcache.tokens import WordTokenizer

KEY = "ab" * 32  # a content key: 64 hex digits


def state(n: int = 50, dtype=torch.float32, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(2, 2, 4, n, 16, generator=g).to(dtype)  # [L, 2, H, n, D]


def chunk_keys(client, key: str) -> list[bytes]:
    return sorted(k for k in client.keys(f"{PREFIX}:{{{key}}}:*") if not k.endswith((b":h", b":lock")))


@pytest.mark.parametrize("direct", [True, False], ids=["direct", "redis-py"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_round_trip_is_bit_identical(redis_server, dtype, direct):
    tier, kv = RedisTier(redis_server.url, direct_reads=direct), state(dtype=dtype)
    assert tier.get(KEY) is None and KEY not in tier
    tier.put(KEY, kv)
    got = tier.get(KEY)
    assert KEY in tier and got.dtype == dtype and torch.equal(got.view(torch.uint8), kv.view(torch.uint8))
    assert tier.stats["hits"] == 1 and tier.stats["misses"] == 1 and tier.stats["errors"] == 0
    assert tier.stats["bytes_in"] == tier.stats["bytes_out"] > kv.numel() * kv.element_size()
    assert RedisTier(redis_server.url).get(KEY) is not None  # another client (replica) reads it too


def test_large_state_is_chunked_and_header_written(redis_server):
    tier, kv = RedisTier(redis_server.url, chunk_bytes=64 << 10), state(n=2000)  # 2 MiB in 64 KiB chunks
    tier.put(KEY, kv)
    client = redis_server.client()
    head = json.loads(client.get(f"{PREFIX}:{{{KEY}}}:h"))
    assert head["chunks"] == len(chunk_keys(client, KEY)) == -(-head["bytes"] // (64 << 10)) > 30
    assert torch.equal(tier.get(KEY), kv)
    tier.evict(KEY)
    assert client.keys(f"{PREFIX}:*") == [] and tier.get(KEY) is None


def test_ttl_is_set_on_header_and_chunks(redis_server):
    tier = RedisTier(redis_server.url, chunk_bytes=4096, ttl=100)
    tier.put(KEY, state())
    client = redis_server.client()
    head_ttl = client.pttl(f"{PREFIX}:{{{KEY}}}:h")
    assert 0 < head_ttl <= 100_000
    assert all(client.pttl(k) > head_ttl for k in chunk_keys(client, KEY))  # chunks outlive the header


def _corrupt_chunk(client, key):
    k = chunk_keys(client, key)[1]
    v = bytearray(client.get(k))
    v[len(v) // 2] ^= 0x01
    client.set(k, bytes(v))


def _truncate_chunk(client, key):
    k = chunk_keys(client, key)[-1]
    client.set(k, client.get(k)[:-10])


def _drop_chunk(client, key):
    client.delete(chunk_keys(client, key)[0])


def _bad_header(client, key):
    client.set(f"{PREFIX}:{{{key}}}:h", b"not json")


def _forged_header(client, key):  # length consistent, but the value is no state
    value = b"\x10" + bytes(999)
    for k in chunk_keys(client, key):
        client.delete(k)
    client.set(f"{PREFIX}:{{{key}}}:0", value)
    client.set(f"{PREFIX}:{{{key}}}:h", json.dumps({"chunks": 1, "bytes": len(value)}))


def _longer_chunk(client, key):  # more bytes than the header says
    k = chunk_keys(client, key)[0]
    client.set(k, client.get(k) + b"x" * 5000)


def _lying_header(client, key):  # claims more bytes than its chunks could hold: nothing is allocated for it
    n = len(chunk_keys(client, key))
    client.set(f"{PREFIX}:{{{key}}}:h", json.dumps({"chunks": n, "bytes": 1 << 40}))


@pytest.mark.parametrize("direct", [True, False], ids=["direct", "redis-py"])
@pytest.mark.parametrize("damage", [_corrupt_chunk, _truncate_chunk, _drop_chunk, _bad_header, _forged_header,
                                    _longer_chunk, _lying_header])
def test_bad_value_is_deleted_and_reported_as_a_miss(redis_server, caplog, damage, direct):
    tier = RedisTier(redis_server.url, chunk_bytes=4096, direct_reads=direct)
    tier.put(KEY, state())
    client = redis_server.client()
    damage(client, KEY)
    with caplog.at_level(logging.WARNING, logger="promptcache.store"):
        assert tier.get(KEY) is None
    assert tier.stats["corrupt"] == 1 and tier.stats["misses"] == 1 and tier.stats["hits"] == 0
    assert "bad value" in caplog.text
    assert client.keys(f"{PREFIX}:*") == []  # deleted: header and every chunk
    tier.put(KEY, state())  # re-published (re-encoded) afterwards, it serves again
    assert torch.equal(tier.get(KEY), state())


def test_fetch_is_hashed_as_it_arrives_and_the_state_is_a_view_of_the_buffer(redis_server):
    tier, kv = RedisTier(redis_server.url, chunk_bytes=64 << 10), state(n=2000)
    tier.put(KEY, kv)
    blob, digest = tier.read_hashed(KEY, "kv")
    assert digest.hashed == kv.numel() * 4 and not digest.failed  # every data byte hashed on arrival
    got = codec.decode(blob, "kv", codec.StateInfo(KEY), digest)
    assert torch.equal(got, kv)
    start = blob.untyped_storage().data_ptr()
    assert start <= got.data_ptr() < start + blob.numel()  # no copy: the state lives in the fetch buffer
    digest.sha.update(b"x")  # the digest is what decode compares: a wrong one is refused
    with pytest.raises(codec.CodecError, match="checksum mismatch"):
        codec.decode(blob, "kv", codec.StateInfo(KEY), digest)


def test_a_dropped_connection_is_replaced(redis_server):
    tier = RedisTier(redis_server.url, retry_after=(0.05, 0.05))
    tier.put(KEY, state())
    assert torch.equal(tier.get(KEY), state())
    assert redis_server.client().client_kill_filter(_type="normal", skipme=True) >= 1  # the pooled connection
    assert tier.get(KEY) is None and tier.stats["errors"] == 1  # it fails once: a miss, then back-off
    time.sleep(0.1)
    assert torch.equal(tier.get(KEY), state())  # a new connection


def test_value_stored_under_another_key_is_refused(redis_server):
    tier, client = RedisTier(redis_server.url), redis_server.client()
    other = "cd" * 32
    tier.put(other, state())
    for k in client.keys(f"{PREFIX}:{{{other}}}:*"):  # copy other's value under KEY, as a buggy writer might
        client.set(k.replace(other.encode(), KEY.encode()), client.get(k))
    assert tier.get(KEY) is None and tier.stats["corrupt"] == 1
    assert torch.equal(tier.get(other), state())


def test_values_are_the_store_codec_format(redis_server):
    tier, client = RedisTier(redis_server.url, chunk_bytes=4096), redis_server.client()
    tier.put(KEY, state())
    value = b"".join(client.get(k) for k in sorted(chunk_keys(client, KEY), key=lambda k: int(k.rsplit(b":", 1)[1])))
    assert torch.equal(codec.decode(value, "kv", codec.StateInfo(KEY, "float32", tuple(state().shape))), state())
    assert tier.exists_many([KEY, "cd" * 32]) == {KEY}  # one pipelined round trip
    redis_server.stop()
    assert tier.exists_many([KEY]) == set() and tier.stats["errors"] == 1  # unavailable: nothing held


def test_namespaces_never_read_each_other(redis_server):
    schema = ('<schema name="s">Intro text. <module name="a">Alpha module text.</module> '
              '<module name="b">Beta.</module></schema>')
    layout = layout_schema(schema, WordTokenizer())
    keys_a, keys_b = content_keys(layout, "model-x", "tenant-a"), content_keys(layout, "model-x", "tenant-b")
    assert keys_a.keys() == keys_b.keys() and not set(keys_a.values()) & set(keys_b.values())
    tier = RedisTier(redis_server.url)
    for i, k in keys_a.items():
        tier.put(k, state(seed=i))
    reader = RedisTier(redis_server.url)  # another replica, in namespace tenant-b
    assert all(k not in reader and reader.get(k) is None for k in keys_b.values())
    assert all(torch.equal(reader.get(k), state(seed=i)) for i, k in keys_a.items())


def test_password_protected_redis(start_redis):
    server = start_redis(password="s3cret pass")
    tier = RedisTier(server.url)
    tier.put(KEY, state())
    assert torch.equal(tier.get(KEY), state()) and tier.stats["errors"] == 0
    assert "s3cret" not in tier.where
    wrong = RedisTier(server.url.replace("s3cret pass", "wrong"))
    assert wrong.get(KEY) is None and KEY not in wrong  # refused: a miss, not an exception
    wrong.put("cd" * 32, state())
    assert wrong.stats["errors"] >= 1 and server.client().exists(f"{PREFIX}:{{{'cd' * 32}}}:h") == 0
    nopass = RedisTier(f"redis://127.0.0.1:{server.port}/0")
    assert nopass.get(KEY) is None and nopass.stats["errors"] == 1


def test_bad_url_is_refused_with_the_reason():
    with pytest.raises(ValueError, match="redis://"):
        RedisTier("http://localhost:6379")
    with pytest.raises(ValueError, match="chunk_bytes"):
        RedisTier("redis://localhost:6379/0", chunk_bytes=0)


def test_encode_lock_one_thread_encodes_the_other_waits(redis_server):
    a, b = RedisTier(redis_server.url, poll=0.01), RedisTier(redis_server.url, poll=0.01)
    results, entered = {}, threading.Event()

    def waiter():
        entered.wait()
        with b.encode_lock(KEY, ttl=30) as mine:
            results["b"] = mine

    t = threading.Thread(target=waiter)
    t.start()
    with a.encode_lock(KEY, ttl=30) as mine:
        results["a"] = mine
        entered.set()
        time.sleep(0.5)  # the waiter is at the lock before it is released (on a busy machine it was not always)
        a.put(KEY, state())
    t.join(timeout=60)
    assert results == {"a": True, "b": False}
    assert redis_server.client().exists(f"{PREFIX}:{{{KEY}}}:lock") == 0  # released


def test_crashed_lock_holder_blocks_nobody_past_the_ttl(redis_server):
    crashed = RedisTier(redis_server.url).encode_lock(KEY, ttl=0.5)
    assert crashed.__enter__() is True  # a holder that dies without releasing (no __exit__)
    with RedisTier(redis_server.url, poll=0.02).encode_lock(KEY, ttl=30) as mine:
        assert mine is True  # took the lock over once it expired, long before its own 30 s wait ran out
        assert redis_server.client().pttl(f"{PREFIX}:{{{KEY}}}:lock") > 20_000


def test_encode_lock_with_redis_down_encodes_at_once(redis_server):
    tier = RedisTier(redis_server.url)
    redis_server.stop()
    with tier.encode_lock(KEY, ttl=30) as mine:
        assert mine is True
    assert tier.stats["errors"] >= 1
