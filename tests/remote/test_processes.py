"""Across OS processes, through ``EngineConfig(store=StoreConfig(remote=...))`` only: a compile in one process serves
another that encodes nothing, and two replicas missing the same schema at once encode it once
(the replicas are in ``remote_worker.py``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

from promptcache import PromptCache
from promptcache.engine import EngineConfig, StoreConfig
from promptcache.models.loading import load_model

WORKER = Path(__file__).resolve().parent / "remote_worker.py"
ROOT = WORKER.parents[2]
SCHEMA, PROMPT = ROOT / "schemas" / "travel.xml", ROOT / "examples" / "travel_tokyo.xml"


def spawn(role: str, url: str, out: Path) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    return subprocess.Popen([sys.executable, str(WORKER), role, url, str(out)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


def finish(proc: subprocess.Popen, out: Path) -> dict:
    output, _ = proc.communicate(timeout=240)
    assert proc.returncode == 0, output.decode(errors="replace")[-3000:]
    return json.loads(out.read_text())


def test_compile_publishes_and_a_fresh_process_encodes_nothing(redis_server, tmp_path):
    a = PromptCache(*load_model("embedded"), EngineConfig(store=StoreConfig(remote=redis_server.url)))  # process A: this one
    a.compile(SCHEMA, tmp_path / "travel")
    want = a.prefill(PROMPT, recompute=0).logits  # bit-equal states give bit-equal splices
    assert a.store.shared_stats()["bytes_out"] > 0 and a.store.shared_stats()["errors"] == 0
    b = finish(spawn("consume", redis_server.url, tmp_path / "b.json"), tmp_path / "b.json")  # process B
    assert b["encodes"] == 0  # nothing encoded: every state came from process A
    assert set(b["hit_tiers"]) == {"remote"} and b["stats"]["hits"] == sum(b["hit_tiers"].values()) > 0
    assert b["stats"]["corrupt"] == 0 and b["stats"]["errors"] == 0
    assert torch.equal(torch.load(tmp_path / "b.json.pt"), want)


def test_two_processes_missing_the_same_schema_encode_it_once(redis_server, tmp_path):
    client = redis_server.client()
    procs = [spawn("race", redis_server.url, tmp_path / f"p{i}.json") for i in range(2)]
    deadline = time.monotonic() + 180
    while int(client.get("test:ready") or 0) < 2:  # both loaded the model and are about to add the schema
        assert time.monotonic() < deadline and all(p.poll() is None for p in procs), \
            "workers did not start: " + "".join(p.communicate()[0].decode()[-2000:] for p in procs if p.poll())
        time.sleep(0.05)
    client.set("test:go", 1)
    reports = [finish(p, tmp_path / f"p{i}.json") for i, p in enumerate(procs)]
    assert sorted(r["encodes"] for r in reports) == [0, 1]  # one encoded, the other waited and fetched
    waiter = next(r for r in reports if r["encodes"] == 0)
    assert set(waiter["hit_tiers"]) == {"remote"}
    logits = [torch.load(tmp_path / f"p{i}.json.pt") for i in range(2)]
    assert torch.equal(logits[0], logits[1])
