"""RAG documents on vLLM without vLLM: a ``DocumentStore`` whose units carry their separator, its
requests (``plan_request(store, (question, doc_ids))``), the connector's checks of them, and the
per-unit rotation against our own engine.

The rotation test plays vLLM's part with the stock model: the connector's states (the prefix at
0, each document's unit rotated from 0 to its start) sit at positions 0..T-1 and the question
runs at T..; the next-token logits must be the engine's (independent mode, recompute=0) within
1e-4 (DESIGN.md §4, float32) for documents in any order.
"""

from __future__ import annotations

import json
import logging

import pytest
import torch
from click.testing import CliRunner
from transformers import DynamicCache

from promptcache import EngineConfig, PromptCache, RecomputeConfig
from promptcache.cli import main
from promptcache.integrations.vllm import SupplyError, cache_salt, kv_transfer_config, plan_request, to_vllm_request
from promptcache.integrations.vllm.documents import DocumentStates
from promptcache.integrations.vllm.rope import rope_inv_freq
from promptcache.integrations.vllm.supply import PARAMS_KEY
from promptcache.rag import DocumentStore, DocumentStoreError
from tiny import make_model, make_tokenizer

DOCS = {
    "paris": "Paris is the capital of France, famous for museums and cafes.",
    "tokyo": "Tokyo is a huge city in Japan with temples, food markets and fast trains.",
    "rome": "Rome is an old city with a famous tower and quiet gardens.",
}
Q, SYS = "What is famous there?", "Answer briefly."
ORDERS = [["paris", "tokyo", "rome"], ["rome", "paris"], ["tokyo", "rome", "paris"], ["rome"]]


@pytest.fixture(scope="module")
def pc():
    return PromptCache(make_model("llama"), make_tokenizer(), EngineConfig(recompute=RecomputeConfig(fraction=0)))


@pytest.fixture(scope="module")
def store(pc, tmp_path_factory):
    s = DocumentStore(pc, tmp_path_factory.mktemp("vllm-docs") / "docs", independent=True, attach_separator=True)
    for k, v in DOCS.items():
        s.add(k, v)
    return s


def model_shape(pc) -> dict:
    spec = pc.runner.stored_spec
    return {"layers": spec.layers, "kv_heads": spec.kv_heads, "head_dim": spec.head_dim}


def vllm_logits(model, kv, token_ids, t):
    """Next-token logits as vLLM computes them: the supplied states at 0..t-1, new tokens at t.."""
    cache = DynamicCache()
    for layer in range(kv.shape[0]):
        cache.update(kv[layer, 0][None], kv[layer, 1][None], layer)
    with torch.no_grad():
        out = model(input_ids=torch.tensor([token_ids[t:]]), position_ids=torch.arange(t, len(token_ids))[None],
                    past_key_values=cache)
    return out.logits[0, -1]


@pytest.mark.parametrize("order", ORDERS, ids="-".join)
def test_units_rotated_to_their_starts_give_the_engines_logits(pc, store, order):
    request = plan_request(store, (Q, order), system=SYS)
    assert request.supply is not None, request.reason
    layout = store.layout(Q, order, SYS)
    assert request.token_ids == layout.token_ids and [s.kind for s in layout.spans][-1] == "new"
    assert request.supply.tokens == len(layout.token_ids) - len(layout.spans[-1])  # all but the question
    states = DocumentStates([store.path], model_shape(pc))
    units, t = states.check(request.supply.params, request.token_ids, request.supply.salt)
    assert t == request.supply.tokens and [u.start for u in units][1:] == \
        [s.position_ids[0] for s in layout.spans if s.name.startswith("doc:")]
    kv = states.kv(units, rope_inv_freq(pc.model.config))
    want = store.prefill(Q, order, SYS, recompute=0).logits
    assert (vllm_logits(pc.model, kv, request.token_ids, t) - want).abs().max().item() <= 1e-4


def test_unrotated_units_differ(pc, store):
    """The rotation is what makes it exact: units left at position 0 move the logits."""
    order = ["tokyo", "rome", "paris"]
    request = plan_request(store, (Q, order), system=SYS)
    states = DocumentStates([store.path], model_shape(pc))
    units, t = states.check(request.supply.params, request.token_ids, request.supply.salt)
    kv = torch.cat([states.kv([u], rope_inv_freq(pc.model.config).zero_()) for u in units], dim=3)  # no rotation
    want = store.prefill(Q, order, SYS, recompute=0).logits
    assert (vllm_logits(pc.model, kv, request.token_ids, t) - want).abs().max().item() > 1e-2


def test_the_separator_is_in_the_unit_and_persisted(pc, store):
    layout = store.layout(Q, ["paris", "rome"], SYS)
    sep = tuple(pc.tok.encode("\n\n"))
    assert [s.kind for s in layout.spans] == ["cached", "cached", "cached", "new"]
    assert layout.spans[1].token_ids == store.get("paris").token_ids + sep
    index = json.loads((store.path / "index.json").read_text())
    assert index["unit_suffix"] == list(sep)
    assert [p["n_tokens"] for p in index["prefixes"]] == [len(layout.spans[0])]
    assert (store.path / "prefixes" / index["prefixes"][0]["file"]).is_file()


def test_salt_and_params_follow_the_order(store):
    a = to_vllm_request(store, (Q, ["paris", "rome"]), system=SYS)["extra_body"]
    b = to_vllm_request(store, (Q, ["rome", "paris"]), system=SYS)["extra_body"]
    c = to_vllm_request(store, ("Another question?", ["rome", "paris"]), system=SYS)["extra_body"]
    assert a["cache_salt"] != b["cache_salt"] and b["cache_salt"] == c["cache_salt"]
    params = b["kv_transfer_params"][PARAMS_KEY]
    assert params["docs"] == [store.get("rome").digest, store.get("paris").digest]
    assert b["cache_salt"] == cache_salt(params)


def test_a_reopened_store_serves_the_same_requests(pc, store):
    again = DocumentStore(pc, store.path, independent=True, attach_separator=True)
    assert to_vllm_request(again, (Q, ["tokyo"]), system=SYS) == to_vllm_request(store, (Q, ["tokyo"]), system=SYS)


def test_a_store_whose_separators_run_is_computed_in_full(pc, tmp_path, caplog):
    plain = DocumentStore(pc, tmp_path / "plain", independent=True)
    plain.add("paris", DOCS["paris"])
    with caplog.at_level(logging.WARNING, logger="promptcache.integrations.vllm.request"):
        request = to_vllm_request(plain, (Q, ["paris"]))
    assert request == {"prompt": plain.layout(Q, ["paris"]).token_ids, "extra_body": {}}
    assert "attach_separator" in caplog.text and "computes this prompt in full" in caplog.text


def test_a_store_without_a_folder_needs_by_key(pc, caplog):
    memory = DocumentStore(pc, independent=True, attach_separator=True)
    memory.add("rome", DOCS["rome"])
    with caplog.at_level(logging.WARNING, logger="promptcache.integrations.vllm.request"):
        assert plan_request(memory, (Q, ["rome"])).supply is None
    assert "without a path" in caplog.text
    assert "states" in plan_request(memory, (Q, ["rome"]), by_key=True).supply.params


def test_a_folder_reopened_with_the_other_unit_is_refused(pc, store):
    with pytest.raises(DocumentStoreError, match="stored with their separator"):
        DocumentStore(pc, store.path, independent=True)


# -- the connector's checks (scheduler side) -----------------------------------------------------------
def checked(store, order=("paris", "rome")):
    request = plan_request(store, (Q, list(order)), system=SYS)
    return dict(request.supply.params), list(request.token_ids), request.supply.salt


@pytest.mark.parametrize("change, message", [
    (lambda p, ids, s: ({**p, "docs": ["0" * 64]}, ids, cache_salt({**p, "docs": ["0" * 64]})), "in none of"),
    (lambda p, ids, s: ({**p, "model": "0" * 64}, ids, cache_salt({**p, "model": "0" * 64})), "in none of"),
    (lambda p, ids, s: (p, ids[:-len(ids) // 3] + [ids[-1]] * (len(ids) // 3), s), "are not document"),
    (lambda p, ids, s: (p, [ids[0] + 1] + ids[1:], s), "not the stored prefix"),
    (lambda p, ids, s: (p, ids, "promptcache-forged"), "cache_salt"),
    (lambda p, ids, s: ({**p, "docs": p["docs"][::-1]}, ids, cache_salt({**p, "docs": p["docs"][::-1]})),
     "are not document"),
    (lambda p, ids, s: ({**p, "prefix_tokens": 0}, ids, s), "'docs' must be"),
    (lambda p, ids, s: ({**p, "v": 7}, ids, s), "version-1"),
])
def test_check_refuses_what_is_not_the_stores(pc, store, change, message):
    params, ids, salt = checked(store)
    p, i, s = change(params, ids, salt)
    with pytest.raises(SupplyError, match=message):
        DocumentStates([store.path], model_shape(pc)).check(p, i, s)


def test_a_document_added_later_is_found(pc, tmp_path):
    s = DocumentStore(pc, tmp_path / "docs", independent=True, attach_separator=True)
    s.add("paris", DOCS["paris"])
    states = DocumentStates([s.path], model_shape(pc))  # the connector starts now
    s.add("oslo", "Oslo sits at the end of a fjord; winters are long and dark.")
    request = plan_request(s, (Q, ["oslo", "paris"]))
    units, t = states.check(request.supply.params, request.token_ids, request.supply.salt)
    assert t == request.supply.tokens and len(units) == 3


def test_a_corrupted_or_foreign_state_is_refused(pc, store, tmp_path):
    import shutil

    bad = tmp_path / "bad"
    shutil.copytree(store.path, bad)
    params, ids, salt = checked(store)
    f = bad / "docs" / f"{params['docs'][0][:32]}.safetensors"
    data = bytearray(f.read_bytes())
    data[-5] ^= 0xFF
    f.write_bytes(bytes(data))
    states = DocumentStates([bad], model_shape(pc))
    units, _ = states.check(params, ids, salt)
    with pytest.raises(SupplyError, match="cannot be used"):
        states.verify(units)
    other = DocumentStates([store.path], {**model_shape(pc), "layers": 99})  # another model's shape
    with pytest.raises(SupplyError, match="cannot be used"):
        other.verify(other.check(params, ids, salt)[0])


def test_vllm_config_names_document_folders(store, tmp_path):
    out = CliRunner().invoke(main, ["vllm-config", "--documents", str(store.path)])
    assert out.exit_code == 0, out.output
    config = json.loads(out.output.strip().splitlines()[-1])
    assert config["kv_connector_extra_config"] == {"compiled": [], "documents": [str(store.path.resolve())]}
    assert kv_transfer_config(documents=[store.path]) == config
    out = CliRunner().invoke(main, ["vllm-config", "--documents", str(tmp_path)])
    assert out.exit_code == 1 and "not a document store folder" in out.output
    out = CliRunner().invoke(main, ["vllm-config"])
    assert out.exit_code == 1 and "--documents DIR" in out.output
