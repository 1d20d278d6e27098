"""PML on vLLM from an engine's own tiers, without vLLM: requests that name states by content key
(``to_vllm_request(..., by_key=True)``), read by the connector's ``KeyedStates`` from a real
redis-server the engine published to, and from its spill folder.

The rotation test plays vLLM's part with the stock model (as tests/integrations does): the
states read by key and rotated sit at 0..T-1, the new tokens run at T..; the logits must be the
engine's at recompute=0 within 1e-4 (DESIGN.md §4) for gapped imports and for documents in a
new order.
"""

from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner
from transformers import DynamicCache

from promptcache import EngineConfig, PromptCache, RecomputeConfig
from promptcache.cli import main
from promptcache.integrations.vllm import SupplyError, cache_salt, plan_request
from promptcache.integrations.vllm.keyed import KeyedStates
from promptcache.integrations.vllm.rope import rope_inv_freq
from promptcache.rag import DocumentStore
from promptcache.store import StoreConfig
from tiny import make_model, make_tokenizer

SCHEMA = """<schema name="trip">You are a travel planner.
  <module name="paris">Paris is the capital of France, famous for museums.</module>
  <module name="tokyo">Tokyo is a huge city in Japan with temples.</module>
  <module name="food">Highlight the food. Keep it cheap.</module>
</schema>"""
GAPPED = '<prompt schema="trip"><paris/><food/> Plan the trip.</prompt>'
DOCS = {"rome": "Rome is an old city with a famous tower and quiet gardens.",
        "oslo": "Oslo sits at the end of a fjord; winters are long and dark.",
        "lima": "Lima is a coastal city known for its food and grey winter skies."}
Q, SYS = "What is famous there?", "Answer briefly."


def engine(**store) -> PromptCache:
    return PromptCache(make_model("llama"), make_tokenizer(),
                       EngineConfig(recompute=RecomputeConfig(fraction=0), store=StoreConfig(**store)))


def shape(pc) -> dict:
    spec = pc.runner.stored_spec
    return {"layers": spec.layers, "kv_heads": spec.kv_heads, "head_dim": spec.head_dim}


def vllm_logits(pc, states: KeyedStates, request):
    params, t = request.supply.params, request.supply.tokens
    got, tokens = states.check(params, request.token_ids, request.supply.salt)
    assert tokens == t
    states.verify(got)
    kv = states.kv(got, rope_inv_freq(pc.model.config))
    cache = DynamicCache()
    for layer in range(kv.shape[0]):
        cache.update(kv[layer, 0][None], kv[layer, 1][None], layer)
    with torch.no_grad():
        out = pc.model(input_ids=torch.tensor([request.token_ids[t:]]),
                       position_ids=torch.arange(t, len(request.token_ids))[None], past_key_values=cache)
    return out.logits[0, -1]


def test_gapped_imports_and_new_document_orders_from_redis(redis_server):
    pc = engine(remote=redis_server.url)
    pc.add_schema(SCHEMA)  # published to Redis as it is encoded (remote_policy "through")
    store = DocumentStore(pc, independent=True, attach_separator=True)
    for k, v in DOCS.items():
        store.add(k, v)
    states = KeyedStates(remote=redis_server.url, model=shape(pc))
    request = plan_request(pc, GAPPED, by_key=True)
    cached = [s for s in pc.layout(GAPPED).spans if s.kind == "cached"]
    assert request.supply.offset < 0 and [s[1] for s in request.supply.params["states"]] == list(map(len, cached))
    assert request.supply.salt != plan_request(pc, GAPPED).supply.salt  # by key: other blocks in vLLM's cache
    want = pc.prefill(GAPPED, recompute=0).logits
    assert (vllm_logits(pc, states, request) - want).abs().max().item() <= 1e-4
    for order in (["lima", "rome", "oslo"], ["oslo", "lima"]):
        request = plan_request(store, (Q, order), system=SYS, by_key=True)
        assert [s[2] for s in request.supply.params["states"]][1:] == \
            [s.position_ids[0] for s in store.layout(Q, order, SYS).spans if s.name.startswith("doc:")]
        want = store.prefill(Q, order, SYS, recompute=0).logits
        assert (vllm_logits(pc, states, request) - want).abs().max().item() <= 1e-4


def test_a_state_redis_lost_is_refused(redis_server):
    pc = engine(remote=redis_server.url)
    pc.add_schema(SCHEMA)
    request = plan_request(pc, GAPPED, by_key=True)
    redis_server.client().flushall()
    states = KeyedStates(remote=redis_server.url, model=shape(pc))
    got, _ = states.check(request.supply.params, request.token_ids, request.supply.salt)
    with pytest.raises(SupplyError, match="in none of the connector's tiers"):
        states.verify(got)


def test_states_from_a_spill_folder(tmp_path):
    pc = engine(spill_dir=str(tmp_path / "spill"), disk_policy="through")
    pc.add_schema(SCHEMA)
    request = plan_request(pc, GAPPED, by_key=True)
    states = KeyedStates(spill_dir=str(tmp_path / "spill"), model=shape(pc))
    assert (vllm_logits(pc, states, request) - pc.prefill(GAPPED, recompute=0).logits).abs().max().item() <= 1e-4
    wrong = KeyedStates(spill_dir=str(tmp_path / "spill"), model={**shape(pc), "kv_heads": 99})
    with pytest.raises(SupplyError, match="vLLM's model and the request need"):
        wrong.verify(wrong.check(request.supply.params, request.token_ids, request.supply.salt)[0])


@pytest.mark.parametrize("change, message", [
    (lambda p, ids, s: (p, ids, "promptcache-forged"), "cache_salt"),
    (lambda p, ids, s: (p, ids[:3], s), "must extend"),
    (lambda p, ids, s: ({**p, "states": [["k", 0, 0]]}, ids, cache_salt({**p, "states": [["k", 0, 0]]})),
     "non-empty list of"),
])
def test_check_refuses_malformed_requests(tmp_path, change, message):
    pc = engine(spill_dir=str(tmp_path / "spill"), disk_policy="through")
    pc.add_schema(SCHEMA)
    request = plan_request(pc, GAPPED, by_key=True)
    p, ids, s = change(dict(request.supply.params), list(request.token_ids), request.supply.salt)
    with pytest.raises(SupplyError, match=message):
        KeyedStates(spill_dir=str(tmp_path / "spill")).check(p, ids, s)
    with pytest.raises(SupplyError, match="no Redis URL or spill folder"):
        KeyedStates().check(request.supply.params, request.token_ids, request.supply.salt)


def test_vllm_config_remote_and_spill_dir(tmp_path):
    out = CliRunner().invoke(main, ["vllm-config", "--remote", "redis://127.0.0.1:6390/0", "--spill-dir", str(tmp_path)])
    assert out.exit_code == 0, out.output
    extra = json.loads(out.output.strip().splitlines()[-1])["kv_connector_extra_config"]
    assert extra["remote"] == "redis://127.0.0.1:6390/0" and extra["spill_dir"] == str(tmp_path.resolve())
    out = CliRunner().invoke(main, ["vllm-config", "--remote", "http://x"])
    assert out.exit_code == 1 and "redis://" in out.output
