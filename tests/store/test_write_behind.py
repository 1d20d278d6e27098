"""The write-behind disk policy: new states are queued to a writer thread, readable until
written, on disk (whole files) within the lag, and what was written survives a SIGKILL."""

from __future__ import annotations

import gc
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from promptcache.errors import ConfigError
from promptcache.store import DiskTier, MemoryTier, StoreConfig, TieredStore, build_store
from promptcache.store.spillfolder import SUFFIX, WriteBehind

ROOT = Path(__file__).resolve().parents[2]


def kv(seed: int, n: int = 3) -> torch.Tensor:
    return torch.randn(2, 2, 2, n, 4, generator=torch.Generator().manual_seed(seed))  # [L, 2, H, n, D]


def test_the_default_disk_policy_is_behind_only_for_a_named_folder(tmp_path):
    assert StoreConfig(spill_dir=str(tmp_path)).disk_write_policy == "behind"
    assert StoreConfig().disk_write_policy == "on_evict"  # a temporary folder dies with the process
    assert StoreConfig(spill_dir=str(tmp_path), disk_policy="through").disk_write_policy == "through"
    for bad, field in ((dict(disk_policy="later"), "disk_policy"), (dict(disk_lag=0), "disk_lag"),
                       (dict(disk_lag=True), "disk_lag")):
        with pytest.raises(ConfigError, match=f"StoreConfig.{field}"):
            StoreConfig(**bad)
    store = build_store("cpu", StoreConfig(spill_dir=str(tmp_path / "s"), disk_lag=0.5))
    disk = store.tiers[-1]
    assert disk.write_policy == "behind" and disk.writer.lag == 0.5
    store.close()


def test_a_put_returns_before_the_write_and_is_readable_until_written(tmp_path):
    disk = DiskTier(tmp_path / "spill", write_policy="behind", lag=5.0)
    gate, real = threading.Event(), disk.write_now
    disk.writer.write = lambda key, state: gate.wait(10) and real(key, state)
    store = TieredStore([MemoryTier("host", "cpu", budget=0), disk])  # memory holds nothing: all goes down
    store.put("a", kv(1))  # returns although the writer is held
    assert "a" in store and not list((tmp_path / "spill").glob("*" + SUFFIX))
    assert torch.equal(store.get("a")[0], kv(1)) and store.get("a")[1] == "disk"  # from the queue
    gate.set()
    disk.flush()
    assert [p.name for p in (tmp_path / "spill").glob("*" + SUFFIX)] == ["a" + SUFFIX]
    assert torch.equal(store.get("a")[0], kv(1)) and disk.writer.written == 1
    store.close()


def test_keep_writes_a_pool_block_to_disk_only(tmp_path):
    store = build_store("cpu", StoreConfig(spill_dir=str(tmp_path / "s")))
    assert store.keeps_new
    store.keep("blk", kv(2))
    store.tiers[-1].flush()
    assert store.tier_of("blk") == "disk" and store.usage()["host"] == 0  # the pool holds its memory
    store.close()
    assert not build_store("cpu", StoreConfig()).keeps_new


def test_the_lag_is_bounded_by_backpressure():
    written, gate, entered = [], threading.Event(), threading.Event()
    writer = WriteBehind(lambda key, state: (entered.set(), gate.wait(10)) and written.append(key), lag=0.2)
    writer.submit("a", kv(1))
    assert entered.wait(10)
    time.sleep(0.3)  # "a" has now waited past the lag
    producer = threading.Thread(target=writer.submit, args=("b", kv(2)))
    producer.start()
    producer.join(0.5)
    assert producer.is_alive()  # the producer waits for the writer instead of queueing more
    gate.set()
    producer.join(10)
    assert not producer.is_alive()
    writer.close()
    assert written == ["a", "b"]


def test_evicted_before_written_is_not_written(tmp_path):
    disk = DiskTier(tmp_path / "spill", write_policy="behind", lag=5.0)
    gate, entered, real = threading.Event(), threading.Event(), disk.write_now
    disk.writer.write = lambda key, state: (entered.set(), gate.wait(10)) and real(key, state)
    disk.put("first", kv(1))
    assert entered.wait(10)  # taken by the writer, held at the gate
    disk.put("second", kv(2))
    disk.evict("second")
    gate.set()
    disk.close()
    assert sorted(p.name for p in (tmp_path / "spill").glob("*" + SUFFIX)) == ["first" + SUFFIX]


CHILD = """
import sys, time, torch
from promptcache.store import StoreConfig, build_store
store = build_store("cpu", StoreConfig(spill_dir=sys.argv[1], disk_lag=0.3))
for i in range(20):
    store.put(f"k{i}", torch.full((2, 2, 2, 64, 8), float(i)))
time.sleep(1.5)  # past the lag: every state is on disk
print("written", flush=True)
for i in range(20, 40):  # more states, then killed while they are being written
    store.put(f"k{i}", torch.full((2, 2, 2, 64, 8), float(i)))
time.sleep(60)
"""


@pytest.mark.slow  # a subprocess imports torch
def test_states_written_behind_survive_a_sigkill(tmp_path):
    folder = tmp_path / "spill"
    child = subprocess.Popen([sys.executable, "-c", CHILD, str(folder)], stdout=subprocess.PIPE, text=True,
                             env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        assert child.stdout.readline().strip() == "written"
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait(30)
    store = build_store("cpu", StoreConfig(spill_dir=str(folder)))
    for i in range(20):  # every state older than the lag is served, verified, after the kill
        state, tier = store.get(f"k{i}")
        assert tier == "disk" and torch.equal(state, torch.full((2, 2, 2, 64, 8), float(i)))
    for i in range(20, 40):  # later ones: whole or absent, never a torn file
        if f"k{i}" in store:
            assert torch.equal(store.get(f"k{i}")[0], torch.full((2, 2, 2, 64, 8), float(i)))
    store.close()


def test_a_behind_tier_nobody_holds_is_collected_and_frees_its_folder(tmp_path):
    disk = DiskTier(tmp_path / "s", write_policy="behind")
    disk.put("a", kv(1))
    disk.flush()
    del disk
    gc.collect()
    again = DiskTier(tmp_path / "s", write_policy="behind")  # the folder's lock went with the first
    assert torch.equal(again.get("a"), kv(1))
    again.close()
