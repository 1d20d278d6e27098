"""The codec's zero-copy decode and ``Digest``, the checksum computed while a value arrives: a
digest is only trusted when it covered exactly the state decoded; anything else is verified again."""

from __future__ import annotations

import random

import pytest
import torch

from promptcache.store import CodecError, StateInfo
from promptcache.store import codec


def value(seed: int = 0, dtype=torch.float32) -> tuple[torch.Tensor, bytes]:
    t = torch.randn(2, 2, 2, 40, 8, generator=torch.Generator().manual_seed(seed)).to(dtype)
    return t, codec.encode({"kv": ("k1", t)}, model="m")[0]


def arrive(blob: bytes, pieces: list[int] | None = None, seed: int = 0) -> tuple[bytearray, codec.Digest]:
    """Copy ``blob`` into a fresh buffer in random pieces, feeding a Digest as a network read would."""
    buf = bytearray(len(blob))
    digest, pos, rng = codec.Digest(memoryview(buf), "kv"), 0, random.Random(seed)
    for n in pieces or iter(lambda: rng.randint(1, 3000), None):
        if pos >= len(blob):
            break
        n = min(n, len(blob) - pos)
        buf[pos : pos + n] = blob[pos : pos + n]
        digest.update(pos, pos + n)
        pos += n
    return buf, digest


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_decode_of_writable_memory_is_a_view_of_it(dtype):
    t, blob = value(dtype=dtype)
    buf = bytearray(blob)
    got = codec.decode(buf, "kv", StateInfo("k1", str(dtype).removeprefix("torch."), tuple(t.shape), "m"))
    assert torch.equal(got, t)
    got.view(-1)[0] = 7  # the state IS the buffer's memory (no copy was made)
    assert bytes(buf) != blob
    tensor = torch.frombuffer(bytearray(blob), dtype=torch.uint8)
    assert codec.decode(tensor, "kv", StateInfo("k1")).data_ptr() >= tensor.data_ptr()
    assert torch.equal(codec.decode(blob, "kv", StateInfo("k1")), t)  # read-only bytes: decoded from a copy


def test_a_digest_fed_in_pieces_is_the_states_checksum_and_decode_uses_it():
    t, blob = value()
    buf, digest = arrive(blob)
    sums = codec.encode({"kv": ("k1", t)}, model="m")[1]
    assert digest.hexdigest() == sums["kv"] and digest.hashed == t.numel() * 4 and not digest.failed
    assert torch.equal(codec.decode(buf, "kv", StateInfo("k1"), digest), t)
    digest.sha.update(b"!")  # decode compares the digest, not a fresh pass: a wrong digest is refused
    with pytest.raises(CodecError, match="checksum mismatch"):
        codec.decode(buf, "kv", StateInfo("k1"), digest)


def test_corrupted_data_is_caught_through_the_digest():
    t, blob = value()
    bad = bytearray(blob)
    bad[-5] ^= 0x10
    buf, digest = arrive(bytes(bad))
    with pytest.raises(CodecError, match="checksum mismatch"):
        codec.decode(buf, "kv", StateInfo("k1"), digest)


def test_a_digest_that_did_not_cover_the_state_is_ignored_and_decode_hashes_itself():
    t, blob = value()
    buf = bytearray(blob)
    out_of_order = codec.Digest(memoryview(buf), "kv")
    out_of_order.update(100, 200)
    assert out_of_order.failed
    assert torch.equal(codec.decode(buf, "kv", StateInfo("k1"), out_of_order), t)
    partial = codec.Digest(memoryview(buf), "kv")
    partial.update(0, len(buf) - 1)  # the last byte never arrived
    assert not partial.covers(partial.prefix, partial.span)
    assert torch.equal(codec.decode(buf, "kv", StateInfo("k1"), partial), t)
    bad = bytearray(blob)
    bad[-1] ^= 0x01  # a partial digest never vouches for data it did not see
    with pytest.raises(CodecError, match="checksum mismatch"):
        codec.decode(bad, "kv", StateInfo("k1"), partial)
    other = codec.Digest(memoryview(buf), "nope")  # another state's name: its header check fails
    other.update(0, len(buf))
    assert other.failed


def test_a_header_entry_that_does_not_match_its_bytes_is_refused():
    t, blob = value()
    text = bytearray(blob)
    at = bytes(text).index(b'"shape":[2,2,2,40,8]')
    text[at : at + 20] = b'"shape":[2,2,2,40,4]'  # half the bytes its offsets span
    with pytest.raises(CodecError, match="unreadable"):
        codec.decode(text, "kv", StateInfo("k1"))
    with pytest.raises(TypeError, match="uint8"):
        codec.decode(torch.zeros(4), "kv", StateInfo("k1"))
