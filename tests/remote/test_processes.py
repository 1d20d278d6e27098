"""Across OS processes: single-flight encoding, and an engine that encodes nothing because another
process published every state (the workers are in ``remote_worker.py``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from promptcache import PromptCache
from promptcache.models.loading import load_model
from promptcache.store.remote import RedisTier

WORKER = Path(__file__).resolve().parent / "remote_worker.py"
ROOT = WORKER.parents[2]


def spawn(role: str, url: str, out: Path) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    return subprocess.Popen([sys.executable, str(WORKER), role, url, str(out)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


def finish(proc: subprocess.Popen, out: Path) -> dict:
    output, _ = proc.communicate(timeout=240)
    assert proc.returncode == 0, output.decode(errors="replace")[-3000:]
    return json.loads(out.read_text())


def test_two_processes_missing_the_same_key_encode_it_once(redis_server, tmp_path):
    client = redis_server.client()
    procs = [spawn("lock", redis_server.url, tmp_path / f"p{i}.json") for i in range(2)]
    deadline = time.monotonic() + 120
    while int(client.get("test:ready") or 0) < 2:  # both imported torch and connected
        assert time.monotonic() < deadline and all(p.poll() is None for p in procs), "workers did not start"
        time.sleep(0.05)
    client.set("test:go", 1)
    reports = [finish(p, tmp_path / f"p{i}.json") for i, p in enumerate(procs)]
    assert int(client.get("test:encodes")) == 1
    assert sorted(r["mine"] for r in reports) == [False, True]
    assert all(r["equal"] for r in reports)


@pytest.fixture(scope="module")
def embedded():
    return load_model("embedded")


SCHEMA, PROMPT = ROOT / "schemas" / "travel.xml", ROOT / "examples" / "travel_tokyo.xml"


def test_engine_in_a_fresh_process_takes_every_state_from_remote(redis_server, embedded, tmp_path):
    pc, tier = PromptCache(*embedded), RedisTier(redis_server.url)  # process A: this one
    entry = pc.add_schema(SCHEMA)
    for key in entry.keys.values():  # publish every stored state
        tier.put(key, pc.store.get(key)[0])
    want = pc.prefill(PROMPT).logits
    assert tier.stats["bytes_out"] > 0 and tier.stats["errors"] == 0
    b = finish(spawn("consume", redis_server.url, tmp_path / "b.json"), tmp_path / "b.json")  # process B
    assert b["encodes"] == 0  # nothing encoded: every state came from process A
    assert b["states"] == len(entry.keys) and set(b["hit_tiers"]) == {"remote"}
    assert b["stats"]["hits"] == sum(b["hit_tiers"].values()) > 0 and b["stats"]["corrupt"] == 0
    assert torch.equal(torch.load(tmp_path / "b.json.pt"), want)


def test_engine_with_redis_down_encodes_locally(redis_server, embedded):
    plain = PromptCache(*embedded)
    plain.add_schema(SCHEMA)
    want = plain.prefill(PROMPT).logits
    tier = RedisTier(redis_server.url)
    redis_server.stop()
    pc = PromptCache(*embedded)
    pc.store.tiers.append(tier)
    pc.add_schema(SCHEMA)  # every module is "missing" (Redis down): encoded here
    res = pc.prefill(PROMPT)
    assert "remote" not in res.hit_tiers and torch.allclose(res.logits, want, atol=1e-4, rtol=0)
    assert tier.stats["errors"] >= 1 and tier.stats["hits"] == 0
