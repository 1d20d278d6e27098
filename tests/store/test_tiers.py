"""The store's parts without an engine: codec, tiers passed in with write policies, a byte tier
(the shape of a remote tier), verification once per handle, reads outside the lock, spill cleanup,
concurrent compiles."""

from __future__ import annotations

import gc
import json
import multiprocessing as mp
import threading

import pytest
import torch

from promptcache import fsutil
from promptcache.store import (ByteTier, CodecError, DiskTier, MemoryTier, StateInfo, StatesFile, StoreConfig,
                               StoreError, TieredStore, build_store)
from promptcache.store import codec


def kv(seed: int, n: int = 3) -> torch.Tensor:
    return torch.randn(2, 2, 2, n, 4, generator=torch.Generator().manual_seed(seed))  # [L, 2, H, n, D]


class DictTier(ByteTier):
    """A remote tier stand-in: a dict of bytes (what a Redis tier's GET/SET/DEL/EXISTS would be)."""

    def __init__(self, policy="through"):
        super().__init__("remote", policy)
        self.values: dict[str, bytes] = {}

    def read(self, key):
        return self.values.get(key)

    def write(self, key, value):
        self.values[key] = value
        return True

    def delete(self, key):
        self.values.pop(key, None)

    def exists(self, key):
        return key in self.values


def test_codec_round_trip_and_what_it_refuses():
    t = kv(0)
    blob, sums = codec.encode({"kv": ("k1", t)}, model="m")
    assert torch.equal(codec.decode(blob, "kv", StateInfo("k1", "float32", tuple(t.shape), "m", sums["kv"])), t)
    for expect, what in ((StateInfo("k2"), "key is k1"), (StateInfo("k1", dtype="bfloat16"), "dtype is F32"),
                         (StateInfo("k1", shape=(1,)), "shape"), (StateInfo("k1", model="x"), "model is m")):
        with pytest.raises(CodecError, match=what):
            codec.decode(blob, "kv", expect)
    i32 = bytearray(blob)
    at = bytes(i32).index(b'"F32"')
    i32[at + 1 : at + 2] = b"I"  # dtype F32 -> I32, same size: the header is covered by the checksum
    with pytest.raises(CodecError, match="checksum mismatch"):
        codec.decode(bytes(i32), "kv", StateInfo("k1"))
    with pytest.raises(CodecError, match="truncated"):
        codec.decode(blob[: len(blob) - 1], "kv", StateInfo("k1"))


def test_default_tiers_and_write_policies(tmp_path):
    assert [t.name for t in build_store("cpu").tiers] == ["host", "disk"]
    with pytest.raises(ValueError, match="write policy"):
        MemoryTier("host", "cpu", write_policy="sometimes")
    remote = DictTier("through")
    store = TieredStore([MemoryTier("host", "cpu", budget=None), DiskTier(tmp_path), remote])
    store.put("a", kv(1))
    assert "a" in remote.values and store.tier_of("a") == "host"  # write-through: published at once
    assert not list(tmp_path.glob("*.safetensors"))  # disk is write-back: nothing until an eviction


def test_byte_tier_serves_verifies_and_deletes_bad_values():
    remote = DictTier("through")
    a = TieredStore([MemoryTier("host", "cpu"), remote])
    a.put("k", kv(2))
    b = TieredStore([MemoryTier("host", "cpu"), remote])  # another replica sharing the remote tier
    got, tier = b.get("k")
    assert tier == "remote" and torch.equal(got, kv(2))
    assert b.get("k")[1] == "host"  # promoted
    remote.values["k2"] = remote.values["k"]  # a value stored under the wrong key
    with pytest.raises(StoreError, match="no stored state"):
        b.get("k2")  # verified like a disk state: refused, a miss
    assert "k2" not in remote.values and remote.stats["corrupt"] == 1  # a bad value is deleted
    assert remote.stats["hits"] == 1 and remote.stats["bytes_in"] == remote.stats["bytes_out"] > 0


def test_shared_tier_on_evict_publishes_what_memory_evicts(tmp_path):
    remote = DictTier("on_evict")
    store = TieredStore([MemoryTier("host", "cpu", budget=kv(0).numel() * 4), DiskTier(tmp_path), remote])
    store.put("a", kv(1))
    assert not remote.values  # nothing published while it stays in memory
    store.put("b", kv(2))  # evicts "a": spilled to disk (local) and published
    assert store.tier_of("a") == "disk" and set(remote.values) == {"a"}
    store.discard("a")  # a local copy dropped: the shared value stays for the other replicas
    assert "a" in remote.values and store.get("a")[1] == "remote"
    with pytest.raises(ValueError, match="shared tiers must come after"):
        TieredStore([DictTier(), MemoryTier("host", "cpu")])


def test_ensure_produces_only_what_no_tier_holds(tmp_path):
    remote = DictTier("through")
    other = TieredStore([MemoryTier("host", "cpu"), remote])  # another replica published "b"
    other.put("b", kv(2))
    store = TieredStore([MemoryTier("host", "cpu"), DiskTier(tmp_path), remote])
    store.put("a", kv(1))
    calls = []

    def produce():
        calls.append(1)
        return {k: kv(i) for i, k in enumerate("abc", 1)}

    assert store.ensure(["a", "b", "c"], produce) == ["c"] and len(calls) == 1
    assert store.tier_of("c") == "host" and "c" in remote.values  # produced here, published (through)
    assert store.get("b")[1] == "remote" and store.get("b")[1] == "host"  # fetched on first use, promoted
    assert store.ensure(["a", "b", "c"], produce) == [] and len(calls) == 1


def test_eviction_goes_down_and_verification_failure_drops_everywhere(tmp_path):
    host = MemoryTier("host", "cpu", budget=0)
    store = TieredStore([host, DiskTier(tmp_path)])
    store.put("a", kv(3))
    assert store.tier_of("a") == "disk" and (tmp_path / "a.safetensors").is_file()
    f = tmp_path / "a.safetensors"
    data = bytearray(f.read_bytes())
    data[-1] ^= 0xFF
    f.write_bytes(bytes(data))
    with pytest.raises(StoreError, match="checksum mismatch"):
        store.get("a")
    assert "a" not in store and not f.exists()  # dropped from every tier, spill file removed
    store.put("a", kv(3))
    assert torch.equal(store.get("a")[0], kv(3))


def test_checksum_is_verified_once_per_handle(tmp_path, monkeypatch):
    path = tmp_path / "s.safetensors"
    sums = codec.write_file(path, {"x": ("kx", kv(4))}, "m")
    disk = DiskTier(tmp_path / "spill")
    expect = StateInfo("kx", "float32", tuple(kv(4).shape), "m", sums["x"])
    disk.add_file(path, {"kx": ("x", expect, 0)})
    calls = []
    real = codec.checksum
    monkeypatch.setattr(codec, "checksum", lambda *a: calls.append(1) or real(*a))
    for _ in range(3):
        assert torch.equal(disk.get("kx"), kv(4))
    assert len(calls) == 1
    disk.add_file(path, {"kx": ("x", expect, 0)})  # registering again: a new handle, verified afresh
    disk.get("kx")
    assert len(calls) == 2


def test_disk_reads_happen_outside_the_store_lock(tmp_path, monkeypatch):
    store = TieredStore([MemoryTier("host", "cpu", budget=0), DiskTier(tmp_path)])
    store.put("slow", kv(5))
    store.put("fast", kv(6))
    store.tiers[0].budget = None
    store.get("fast")  # now in host memory
    entered, release = threading.Event(), threading.Event()
    real = StatesFile.read

    def slow_read(self, name, expect):
        entered.set()
        release.wait(10)
        return real(self, name, expect)

    monkeypatch.setattr(StatesFile, "read", slow_read)
    t = threading.Thread(target=store.get, args=("slow",))
    t.start()
    assert entered.wait(10)
    got = []
    other = threading.Thread(target=lambda: got.append(store.get("fast")[1]))
    other.start()
    other.join(5)
    assert got == ["host"]  # served while the disk read is still in progress
    release.set()
    t.join(10)


def test_default_spill_folder_is_removed():
    disk = DiskTier()
    disk.put("k", kv(7))
    folder = disk.spill_dir
    assert folder.is_dir()
    del disk
    gc.collect()
    assert not folder.exists()


def test_register_file_replaces_a_stale_entry(tmp_path):
    good = tmp_path / "g.safetensors"
    sums = codec.write_file(good, {"x": ("kx", kv(8))}, "m")
    store = build_store("cpu", StoreConfig(spill_dir=str(tmp_path / "spill")))
    store.put("kx", kv(9))  # a stale state under the same key, in memory
    store.register_file(good, {"kx": ("x", StateInfo("kx", checksum=sums["x"]), 0)})
    assert torch.equal(store.get("kx")[0], kv(8))


def _compile(args):
    schemas, out = args
    from promptcache import PromptCache
    from tiny import make_model, make_tokenizer

    pc = PromptCache(make_model("llama", 0), make_tokenizer())
    for schema in schemas:
        pc.compile(schema, out)


def test_concurrent_compiles_leave_one_consistent_artifact(tmp_path):
    out = tmp_path / "art"
    schemas = [f'<schema name="s{i}"><system>Rule {i}.</system><user><module name="m">Text {i} here.</module>'
               f'</user></schema>' for i in range(6)]
    with mp.get_context("spawn").Pool(2) as pool:  # two processes, three compiles each, one folder
        pool.map(_compile, [(schemas[:3], str(out)), (schemas[3:], str(out))])
    manifest = json.loads((out / "manifest.json").read_text())
    files = sorted(p.name for p in out.glob("modules-*.safetensors"))
    assert files == [manifest["states"]["file"]]  # exactly the file the manifest names
    assert not list(out.glob(".*.tmp"))
    from promptcache import PromptCache
    from tiny import make_model, make_tokenizer

    pc = PromptCache(make_model("llama", 0), make_tokenizer())
    entry = pc.load_compiled(out, verify=True)
    assert entry.name == manifest["schema"]["name"]


def test_folder_lock_serializes(tmp_path):
    order = []

    def hold(tag):
        with fsutil.folder_lock(tmp_path):
            order.append(f"{tag}+")
            threading.Event().wait(0.05)
            order.append(f"{tag}-")

    threads = [threading.Thread(target=hold, args=(t,)) for t in "ab"]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert order in (["a+", "a-", "b+", "b-"], ["b+", "b-", "a+", "a-"])


def test_atomic_write_fsyncs_file_and_folder(tmp_path, monkeypatch):
    synced = []
    real = fsutil.os.fsync
    monkeypatch.setattr(fsutil.os, "fsync", lambda fd: synced.append(fd) or real(fd))
    fsutil.atomic_write(tmp_path / "sub" / "f.txt", "hé")
    assert (tmp_path / "sub" / "f.txt").read_text(encoding="utf-8") == "hé" and len(synced) == 2
    assert [p.name for p in (tmp_path / "sub").iterdir()] == ["f.txt"]


def test_read_only_artifact_folder_still_loads(tmp_path):
    import os

    from promptcache import PromptCache
    from tiny import make_model, make_tokenizer

    out = tmp_path / "ro"
    schema = '<schema name="ro"><system>Be brief.</system><user><module name="m">Some text.</module></user></schema>'
    PromptCache(make_model("llama", 0), make_tokenizer()).compile(schema, out)
    (out / fsutil.LOCK_NAME).unlink()
    os.chmod(out, 0o555)
    try:
        if os.access(out, os.W_OK):  # running as root: a read-only folder cannot be simulated by mode bits
            real_open = open

            def no_write(path, mode="r", *a, **k):
                if str(path).endswith(fsutil.LOCK_NAME):
                    raise PermissionError(13, "Read-only file system", str(path))
                return real_open(path, mode, *a, **k)

            import builtins
            from unittest import mock

            with mock.patch.object(builtins, "open", no_write):
                entry = PromptCache(make_model("llama", 0), make_tokenizer()).load_compiled(out, verify=True)
        else:
            entry = PromptCache(make_model("llama", 0), make_tokenizer()).load_compiled(out, verify=True)
        assert entry.name == "ro"
    finally:
        os.chmod(out, 0o755)
