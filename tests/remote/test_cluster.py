"""The remote tier against a real 3-node Redis Cluster (``redis+cluster://``): each state's chunks,
header and lock on one node by their hash tag, states spread over the nodes, and a node failure
costing only the states on it (encoded again), never a wrong answer."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
import torch

from promptcache import PromptCache
from promptcache.engine import EngineConfig, StoreConfig
from promptcache.models.loading import load_model
from promptcache.store.remote import PREFIX, RedisTier

ROOT = Path(__file__).resolve().parents[2]
SCHEMA, PROMPT = ROOT / "schemas" / "travel.xml", ROOT / "examples" / "travel_tokyo.xml"


def kv(seed: int) -> torch.Tensor:
    return torch.randn(2, 2, 2, 40, 8, generator=torch.Generator().manual_seed(seed))  # [L, 2, H, n, D]


def key(i: int) -> str:
    return hashlib.sha256(str(i).encode()).hexdigest()


def holders(cluster) -> dict[str, set[int]]:
    """content key -> the nodes (by index) that hold any of its keys."""
    out: dict[str, set[int]] = {}
    for i, node in enumerate(cluster.nodes):
        if node.proc is None:
            continue
        for k in node.client().keys(f"{PREFIX}:*"):
            out.setdefault(k.decode().split("{")[1].split("}")[0], set()).add(i)
    return out


@pytest.mark.parametrize("direct", [True, False])
def test_each_state_lives_on_one_node_and_states_spread(redis_cluster, direct):
    tier = RedisTier(redis_cluster.url, chunk_bytes=1000, direct_reads=direct)  # ~10 chunks per state
    for i in range(12):
        tier.put(key(i), kv(i))
    where = holders(redis_cluster)
    assert set(where) == {key(i) for i in range(12)}
    assert all(len(nodes) == 1 for nodes in where.values())  # chunks + header on one node (hash tag)
    assert len(set().union(*where.values())) == 3  # and the states over all three
    for i in range(12):
        assert torch.equal(tier.get(key(i)), kv(i))
    with tier.encode_lock(key(99)) as mine:
        assert mine
    assert tier.stats["errors"] == 0
    tier.close()


def test_a_node_failure_loses_only_its_states(redis_cluster):
    tier = RedisTier(redis_cluster.url, chunk_bytes=1000)
    for i in range(12):
        tier.put(key(i), kv(i))
    where = holders(redis_cluster)
    redis_cluster.nodes[1].stop()
    for i in range(12):
        got = tier.get(key(i))
        if where[key(i)] == {1}:
            assert got is None  # lost with its node: a miss, the caller encodes it again
        else:
            assert torch.equal(got, kv(i))  # still served: no tier-wide back-off for one node
    tier.close()


@pytest.mark.slow  # encodes the travel schema three times on the embedded model
def test_replicas_on_a_cluster_with_a_dead_node_answer_exactly(redis_cluster):
    model = load_model("embedded")
    reference = PromptCache(*model)
    reference.add_schema(SCHEMA)
    want = reference.prefill(PROMPT).logits
    first = PromptCache(*model, EngineConfig(store=StoreConfig(remote=redis_cluster.url)))
    first.add_schema(SCHEMA)  # encodes and publishes every state (write-through)
    published = holders(redis_cluster)
    assert len(set().union(*published.values())) >= 2
    redis_cluster.nodes[2].stop()
    fresh = PromptCache(*model, EngineConfig(store=StoreConfig(remote=redis_cluster.url)))  # a replica started after the failure
    fresh.add_schema(SCHEMA)
    res = fresh.prefill(PROMPT)
    assert res.hit_tiers.get("remote", 0) > 0  # the live nodes' states were fetched
    assert torch.max(torch.abs(res.logits - want)).item() <= 1e-4  # the lost ones encoded again: same answer
