"""The shared tier through the engine (``EngineConfig(store=StoreConfig(remote=...))``), several engines in this process
standing for replicas: bad values, outages, namespaces, passwords, write policies, metrics."""

from __future__ import annotations

import logging
import sys
import time
from pathlib import Path

import pytest
import torch

from promptcache import PromptCache
from promptcache.engine import EngineConfig
from promptcache.models.loading import load_model
from promptcache.store import StoreConfig, build_store
from promptcache.store.remote import PREFIX

ROOT = Path(__file__).resolve().parents[2]
SCHEMA, PROMPT = ROOT / "schemas" / "travel.xml", ROOT / "examples" / "travel_tokyo.xml"


@pytest.fixture(scope="module")
def embedded():
    return load_model("embedded")


@pytest.fixture(scope="module")
def reference(embedded):
    pc = PromptCache(*embedded)
    pc.add_schema(SCHEMA)
    return pc.prefill(PROMPT).logits


def replica(embedded, url, namespace: str = "default", **store) -> PromptCache:
    """A fresh engine on the shared model; ``pc.encodes`` counts its schema encodings."""
    pc = PromptCache(*embedded, EngineConfig(store=StoreConfig(remote=url, **store), namespace=namespace))
    encode, pc.encodes = pc.encoder.encode, []
    pc.encoder.encode = lambda *a, **k: pc.encodes.append(1) or encode(*a, **k)
    return pc


def values(client) -> list[bytes]:
    return sorted(k for k in client.keys(f"{PREFIX}:*") if k.endswith(b":h"))


def damage_all(client, how: str) -> None:
    for head in values(client):
        chunk = head[:-1] + b"0"
        v = client.get(chunk)
        client.set(chunk, v[:-7] if how == "truncate" else v[:-3] + bytes([v[-3] ^ 0x10]) + v[-2:])


@pytest.mark.parametrize("how", ["flip", "truncate"])
def test_bad_values_are_deleted_and_reencoded_by_the_prompt(redis_server, embedded, reference, caplog, how):
    a = replica(embedded, redis_server.url)
    a.add_schema(SCHEMA)  # encodes and publishes (write-through)
    client = redis_server.client()
    published = values(client)
    assert len(published) == len(a.schema("travel").keys)
    damage_all(client, how)
    b = replica(embedded, redis_server.url)
    b.add_schema(SCHEMA)
    assert b.encodes == []  # the values are there (checked unverified: one pipelined EXISTS)
    with caplog.at_level(logging.WARNING):
        res = b.prefill(PROMPT)
    assert torch.allclose(res.logits, reference, atol=1e-4, rtol=0) and len(b.encodes) == 1
    assert "bad value" in caplog.text and "re-encoding" in caplog.text
    assert b.store.shared_stats()["corrupt"] >= 1
    assert values(client) == published  # re-encoded states published again, good this time
    c = replica(embedded, redis_server.url)
    c.add_schema(SCHEMA)
    assert torch.equal(c.prefill(PROMPT).logits, res.logits) and c.encodes == []
    assert c.store.shared_stats()["corrupt"] == 0


def test_redis_killed_mid_run_then_restarted(redis_server, embedded, reference):
    replica(embedded, redis_server.url).add_schema(SCHEMA)  # published
    b = replica(embedded, redis_server.url)
    b.add_schema(SCHEMA)
    assert b.encodes == []
    redis_server.stop()  # between add_schema and the prompt: the states it counted on vanish
    res = b.prefill(PROMPT)
    assert torch.allclose(res.logits, reference, atol=1e-4, rtol=0) and len(b.encodes) == 1
    assert b.store.shared_stats()["errors"] >= 1
    assert torch.equal(b.prefill(PROMPT).logits, res.logits)  # local from now on
    redis_server.start()  # same port, empty
    time.sleep(1.1)  # past b's first back-off
    c = replica(embedded, redis_server.url)
    c.add_schema(SCHEMA)  # Redis is empty again: encodes and publishes
    d = replica(embedded, redis_server.url)
    d.add_schema(SCHEMA)
    res_d = d.prefill(PROMPT)
    assert len(c.encodes) == 1 and d.encodes == [] and set(res_d.hit_tiers) == {"remote"}
    assert torch.equal(res_d.logits, c.prefill(PROMPT).logits)
    assert b.store.get(next(iter(b.schema("travel").keys.values())))[1] == "host"  # b recovered quietly


def test_redis_down_from_the_start_serves_locally(redis_server, embedded, reference):
    url = redis_server.url
    redis_server.stop()
    pc = replica(embedded, url)
    pc.add_schema(SCHEMA)
    res = pc.prefill(PROMPT)
    assert "remote" not in res.hit_tiers and torch.allclose(res.logits, reference, atol=1e-4, rtol=0)
    assert pc.store.shared_stats()["errors"] >= 1 and pc.store.shared_stats()["hits"] == 0


def test_namespaces_never_read_each_other(redis_server, embedded):
    a = replica(embedded, redis_server.url, namespace="tenant-a")
    a.add_schema(SCHEMA)
    client = redis_server.client()
    n = len(values(client))
    b = replica(embedded, redis_server.url, namespace="tenant-b")
    b.add_schema(SCHEMA)
    res = b.prefill(PROMPT)
    assert len(b.encodes) == 1 and "remote" not in res.hit_tiers and b.store.shared_stats()["hits"] == 0
    assert len(values(client)) == 2 * n  # two sets of states, none shared
    a2 = replica(embedded, redis_server.url, namespace="tenant-a")
    a2.add_schema(SCHEMA)
    assert a2.encodes == [] and set(a2.prefill(PROMPT).hit_tiers) == {"remote"}


def test_password_protected_redis(start_redis, embedded, reference):
    server = start_redis(password="s3cret pass")
    replica(embedded, server.url).add_schema(SCHEMA)
    b = replica(embedded, server.url)
    b.add_schema(SCHEMA)
    res = b.prefill(PROMPT)
    assert b.encodes == [] and set(res.hit_tiers) == {"remote"} and b.store.shared_stats()["errors"] == 0
    assert "s3cret" not in b.store.shared[0].where
    wrong = replica(embedded, server.url.replace("s3cret pass", "wrong"))
    wrong.add_schema(SCHEMA)  # refused by Redis: encoded locally, never an exception
    assert len(wrong.encodes) == 1 and wrong.store.shared_stats()["errors"] >= 1
    assert torch.allclose(wrong.prefill(PROMPT).logits, reference, atol=1e-4, rtol=0)


def test_on_evict_publishes_what_memory_evicts_and_compile_publishes_always(redis_server, embedded, tmp_path):
    client = redis_server.client()
    kept = replica(embedded, redis_server.url, remote_policy="on_evict")
    kept.add_schema(SCHEMA)
    assert values(client) == []  # every state still in memory: nothing published yet
    kept.compile(SCHEMA, tmp_path / "travel")  # compile publishes whatever the policy
    assert len(values(client)) == len(kept.schema("travel").keys)
    client.flushdb()
    tight = replica(embedded, redis_server.url, remote_policy="on_evict", host_budget=150 * 4096)  # ~150 tokens
    tight.add_schema(SCHEMA)  # memory evicts the least recently used states to disk: those are published
    keys = tight.schema("travel").keys.values()
    published = {k for k in keys if f"{PREFIX}:{{{k}}}:h".encode() in values(client)}
    assert published and all(tight.store.tier_of(k) == "disk" for k in published)  # only evicted ones
    with pytest.raises(ValueError, match="remote_policy"):
        StoreConfig(remote=redis_server.url, remote_policy="sometimes")


def test_missing_redis_client_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "redis", None)  # as if the client were not installed
    monkeypatch.delitem(sys.modules, "promptcache.store.remote", raising=False)
    with pytest.raises(ImportError, match=r'pip install "promptcache\[remote\]"'):
        build_store("cpu", StoreConfig(remote="redis://127.0.0.1:1/0"))
    assert [t.name for t in build_store("cpu").tiers] == ["host", "disk"]  # no remote: redis never imported


def test_server_metrics_count_remote_hits_and_errors(redis_server, embedded):
    from promptcache.server.core.metrics import Metrics

    replica(embedded, redis_server.url).add_schema(SCHEMA)
    pc = replica(embedded, redis_server.url)
    pc.add_schema(SCHEMA)
    hits = sum(pc.prefill(PROMPT).hit_tiers.values())
    redis_server.stop()
    pc.store.shared[0].exists("x" * 64)  # one failure

    class Idle:  # a backend (and prefix cache) with nothing running and an empty one-block pool
        in_flight = blocks_stored = published_blocks = 0

        def stats(self):
            return {}

        class scheduler:
            decode_forwards = decode_tokens = 0
            running = ()

        class pool:
            buf = torch.zeros(1)

            @staticmethod
            def describe():
                return {"state": ["free"], "entries": []}

    text = Metrics(Idle(), Idle(), pc.store).render().decode()
    assert f"promptcache_remote_hits_total {float(hits)}" in text
    assert "promptcache_remote_errors_total 1.0" in text and "promptcache_remote_corrupt_total 0.0" in text
    assert "promptcache_remote" not in Metrics(Idle(), Idle(), PromptCache(*embedded).store).render().decode()
