"""A named spill folder survives a restart: the disk tier indexes what it finds (ours only), in the
background when large, within its budget; ``TieredStore.persist`` writes what memory held; one
owner at a time."""

from __future__ import annotations

import hashlib
import os
import time

import pytest
import torch

from promptcache.store import DiskTier, MemoryTier, StoreConfig, StoreError, TieredStore, build_store
from promptcache.store import disk as disk_module
from promptcache.store.spillfolder import SpillFolderBusy


def kv(seed: int, n: int = 3) -> torch.Tensor:
    return torch.randn(2, 2, 2, n, 4, generator=torch.Generator().manual_seed(seed))  # [L, 2, H, n, D]


def key(i: int) -> str:
    return hashlib.sha256(str(i).encode()).hexdigest()  # content keys look like this


def file_bytes(folder, *ids) -> int:
    return sum((folder / f"{key(i)}.safetensors").stat().st_size for i in ids)


def spill(folder, n: int) -> None:
    """A previous process's folder: n states, state i used at time 1000 + i."""
    d = DiskTier(folder)
    for i in range(n):
        d.put(key(i), kv(i))
        os.utime(folder / f"{key(i)}.safetensors", (1000 + i, 1000 + i))
    d.close()


def test_restart_indexes_the_states_found_least_recently_used_first(tmp_path):
    spill(tmp_path, 3)
    os.utime(tmp_path / f"{key(0)}.safetensors", (2000, 2000))  # state 0 was used last
    d = DiskTier(tmp_path)
    assert all(key(i) in d for i in range(3)) and d.bytes_used == file_bytes(tmp_path, 0, 1, 2)
    assert d.lru() == key(1)
    assert torch.equal(d.get(key(2)), kv(2))  # read and verified by the codec
    assert (tmp_path / f"{key(2)}.safetensors").stat().st_mtime > 2000  # a read marks it used


def test_restart_leaves_other_files_alone_and_cleans_ours(tmp_path):
    spill(tmp_path, 2)
    (tmp_path / "notes.txt").write_text("mine")
    (tmp_path / "model.safetensors").write_bytes(b"not ours")
    (tmp_path / f"{key(7)}.safetensors").write_bytes(b"\x08" + b"\0" * 7 + b"damaged!")  # named like ours
    temp = tmp_path / f".{key(8)}.safetensors.0123abcd.tmp"  # a writer killed before its rename
    temp.write_bytes(b"partial")
    d = DiskTier(tmp_path)
    assert key(0) in d and key(1) in d and key(7) not in d
    assert (tmp_path / "notes.txt").read_text() == "mine" and (tmp_path / "model.safetensors").exists()
    assert not (tmp_path / f"{key(7)}.safetensors").exists() and not temp.exists()


def test_restart_trims_a_folder_over_its_budget_oldest_first(tmp_path):
    spill(tmp_path, 4)
    d = DiskTier(tmp_path, budget=file_bytes(tmp_path, 2, 3))
    assert [key(i) in d for i in range(4)] == [False, False, True, True]
    assert sorted(p.name for p in tmp_path.glob("*.safetensors")) == sorted(f"{key(i)}.safetensors" for i in (2, 3))


def test_a_damaged_state_found_at_restart_is_refused_and_dropped(tmp_path):
    spill(tmp_path, 1)
    f = tmp_path / f"{key(0)}.safetensors"
    data = bytearray(f.read_bytes())
    data[-1] ^= 0xFF  # the header is intact, the data is not
    f.write_bytes(bytes(data))
    store = TieredStore([MemoryTier("host", "cpu"), DiskTier(tmp_path)])
    assert key(0) in store
    with pytest.raises(StoreError, match="checksum"):
        store.get(key(0))
    assert key(0) not in store and not f.exists()


def test_large_folders_are_indexed_in_the_background(tmp_path, monkeypatch):
    spill(tmp_path, 3)
    monkeypatch.setattr(disk_module, "SCAN_IN_BACKGROUND", 1)
    d = DiskTier(tmp_path)
    assert d.wait_ready(30)
    assert all(key(i) in d for i in range(3)) and d.lru() == key(0)


def test_one_owner_per_folder(tmp_path):
    d = DiskTier(tmp_path)
    with pytest.raises(SpillFolderBusy, match=str(tmp_path)):
        DiskTier(tmp_path)
    d.close()
    DiskTier(tmp_path).close()  # released: the next owner may take it


def test_persist_writes_what_memory_holds_within_the_disk_budget(tmp_path):
    spill(tmp_path / "probe", 2)
    budget = file_bytes(tmp_path / "probe", 0, 1)  # two states' files
    store = build_store("cpu", StoreConfig(spill_dir=str(tmp_path / "spill"), disk_budget=budget,
                                           disk_policy="on_evict"))
    for i in range(3):
        store.put(key(i), kv(i))  # all in host memory (unbounded)
    assert not list((tmp_path / "spill").glob("*.safetensors"))
    assert store.persist() >= 2  # chosen by data bytes; headers may make the oldest go again
    assert store.usage()["disk"] <= budget  # the oldest made room
    store.close()
    again = build_store("cpu", StoreConfig(spill_dir=str(tmp_path / "spill"), disk_budget=budget))
    assert key(0) not in again and key(2) in again
    got, tier = again.get(key(1))
    assert tier == "disk" and torch.equal(got, kv(1))
    again.close()


def test_persist_without_a_named_folder_writes_nothing():
    store = build_store("cpu", StoreConfig())
    store.put(key(0), kv(0))
    assert store.persist() == 0


def test_write_through_disk_keeps_states_of_a_killed_process_within_budget(tmp_path):
    spill(tmp_path / "probe", 2)
    budget = file_bytes(tmp_path / "probe", 0, 1)
    tmp_path = tmp_path / "spill"
    store = build_store("cpu", StoreConfig(spill_dir=str(tmp_path), disk_budget=budget, disk_policy="through"))
    for i in range(3):
        store.put(key(i), kv(i))
        time.sleep(0.01)
    assert store.tier_of(key(0)) == "host"  # memory keeps it; the disk copy made room for newer ones
    assert sorted(p.name for p in tmp_path.glob("*.safetensors")) == sorted(f"{key(i)}.safetensors" for i in (1, 2))
    assert store.usage()["disk"] <= budget


def test_disk_settings_are_checked():
    from promptcache.errors import ConfigError

    with pytest.raises(ConfigError, match="disk_budget"):
        StoreConfig(disk_budget=-1)
    with pytest.raises(ConfigError, match="disk_policy"):
        StoreConfig(disk_policy="sometimes")
