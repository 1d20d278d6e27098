"""The RAG document store: add, persist, reload, generate. Independent documents are exact against
their definition; chains (the default) against a plain forward (``test_chains.py``)."""

from __future__ import annotations

import json

import pytest
import torch

from promptcache import PromptCache
from promptcache.models import UnsupportedModelError
from promptcache.rag import DocumentStore, DocumentStoreError, UnknownDocumentError
from promptcache.store import StoreError
from tiny import FIRST_TIER, make_model, make_tokenizer

DOCS = {
    "paris": "Paris is the capital of France, famous for museums and cafes.",
    "tokyo": "Tokyo is a huge city in Japan with temples, food markets and fast trains.",
    "rome": "Rome is an old city with a famous tower and quiet gardens.",
}


def make_store(family="llama", path=None, seed=0, **kw):
    pc = PromptCache(make_model(family, seed), make_tokenizer())
    return DocumentStore(pc, path, **kw)


def definition_logits(store, question, doc_ids, system):
    """Prefix encoded as usual, each document encoded after the store's ``encode_prefix`` (alone
    where it has none), that prefix placed just before the document's final positions and only the document's
    states kept, question on top."""
    pc, layout = store.pc, store.layout(question, doc_ids, system)
    ids, pos = [], []
    for span in layout:
        if span.kind == "cached" and span.name == "(prefix)":
            ids, pos = list(span.token_ids), list(span.position_ids)
    kv_parts, positions = [], []
    if ids:
        kv_parts.append(pc.encode_span(ids, 0))
        positions += pos
    for d in doc_ids:
        span = next(s for s in layout if s.name == f"doc:{d}")
        anchor, start = list(store.encode_prefix), span.position_ids[0]
        kv_parts.append(pc.encode_span(anchor + pc.tok.encode(DOCS[d]), start - len(anchor))[:, :, :, len(anchor):])
        positions += list(span.position_ids)
    kv = torch.cat(kv_parts, dim=3)
    new = [s for s in layout if s.kind == "new"]  # separators and the question, run together on top
    from promptcache.models.splice import SpliceCache

    cache = SpliceCache(pc.spec, kv.shape[3] + 64, device=pc.device)
    cache.write(0, kv, torch.tensor(positions, device=pc.device))
    cache.set_length(kv.shape[3])
    ids = [t for s in new for t in s.token_ids]
    pos = [p for s in new for p in s.position_ids]
    return pc.adapter.forward(torch.tensor([ids], device=pc.device), torch.tensor([pos], device=pc.device), cache)[0]


@pytest.mark.parametrize("prefixed", [True, False], ids=["prefixed", "alone"])
@pytest.mark.parametrize("family", ["llama", "gpt_neox", "bloom"])
def test_independent_generate_equals_definition(family, prefixed):
    store = make_store(family, independent=True, prefixed=prefixed)
    assert (len(store.encode_prefix) > 0) == prefixed
    for k, v in DOCS.items():
        store.add(k, v, {"lang": "en"})
    for doc_ids, system in ((["tokyo", "paris"], "Answer briefly."), (["rome"], None), ([], "Be kind.")):
        res = store.prefill("What is famous there?", doc_ids, system, recompute=0)  # the paper's splice
        ref = definition_logits(store, "What is famous there?", doc_ids, system)
        assert torch.max(torch.abs(res.logits - ref)).item() <= 1e-4, (family, doc_ids)
        assert res.new_tokens < 20 + 2 * len(doc_ids) and res.cached_tokens > 10 * len(doc_ids)
    out = store.generate("What is famous there?", ["tokyo", "paris"], system="Answer briefly.", max_new_tokens=8)
    assert len(out.token_ids) >= 1 and out.cached_tokens > 30
    assert "".join(store.stream("What is famous there?", ["tokyo", "paris"], system="Answer briefly.",
                                max_new_tokens=8)) == out.text


@pytest.mark.parametrize("independent", [False, True])
def test_documents_are_placed_contiguously_in_the_given_order_and_separated(independent):
    store = make_store(independent=independent)
    for k, v in DOCS.items():
        store.add(k, v)
    layout = store.layout("Q?", ["rome", "paris"], "S.")
    spans = list(layout)
    names = ["(prefix)", "doc:rome", "doc:paris", "(question)"]
    if independent:
        names = ["(prefix)", "doc:rome", "(separator)", "doc:paris", "(separator)", "(question)"]
    assert [s.name for s in spans] == names
    text = store.pc.tokenizer.decode(layout.token_ids)
    assert DOCS["rome"] + "\n\n" + DOCS["paris"] + "\n\nQ?" in text  # written as text, never glued
    for a, b in zip(spans, spans[1:]):
        assert b.position_ids[0] == a.position_ids[-1] + 1


def test_unknown_document_id_is_a_clear_error():
    store = make_store()
    store.add("paris", DOCS["paris"])
    with pytest.raises(UnknownDocumentError, match="unknown document id 'lyon' .*1 documents: paris"):
        store.generate("Q?", ["lyon"])
    with pytest.raises(ValueError, match="empty"):
        store.add("blank", "")


def test_persist_and_reload(tmp_path):
    store = make_store(path=tmp_path / "docs", independent=True)
    for k, v in DOCS.items():
        store.add(k, v, {"n": len(v)})
    ref = store.prefill("Where?", ["paris", "rome"], "S.").logits
    index = json.loads((tmp_path / "docs" / "index.json").read_text())
    assert [d["id"] for d in index["documents"]] == list(DOCS)
    reopened = make_store(path=tmp_path / "docs", independent=True)  # a fresh engine: states come from disk
    assert reopened.ids() == list(DOCS) and reopened.get("paris").metadata == {"n": len(DOCS["paris"])}
    res = reopened.prefill("Where?", ["paris", "rome"], "S.")
    assert "disk" in res.hit_tiers
    assert torch.allclose(res.logits, ref, atol=1e-6)
    reopened.remove("rome")
    assert make_store(path=tmp_path / "docs").ids() == ["paris", "tokyo"]


def test_reload_with_another_model_is_refused_or_reencoded(tmp_path):
    store = make_store(path=tmp_path / "d")
    store.add("paris", DOCS["paris"])
    with pytest.raises(DocumentStoreError, match="model weights differs"):
        make_store(path=tmp_path / "d", seed=1)
    again = make_store(path=tmp_path / "d", seed=1, reencode=True)
    assert again.ids() == ["paris"]
    assert make_store(path=tmp_path / "d", seed=1).ids() == ["paris"]  # now built for the new model


def _damage_one_byte(folder):
    f = next((folder / "docs").glob("*.safetensors"))
    data = bytearray(f.read_bytes())
    data[-8] ^= 0xFF
    f.write_bytes(bytes(data))
    return f


def test_corrupted_document_states_are_never_used_and_healed_on_read(tmp_path, caplog):
    store = make_store(path=tmp_path / "c")
    store.add("paris", DOCS["paris"])
    ref = store.prefill("Q?", ["paris"]).logits
    f = _damage_one_byte(tmp_path / "c")
    reopened = make_store(path=tmp_path / "c", independent=True)
    with caplog.at_level("WARNING", logger="promptcache"):
        res = reopened.prefill("Q?", ["paris"])  # the bad copy is refused, the text encoded again
    assert "checksum mismatch" in caplog.text and "encoded again" in caplog.text
    assert torch.allclose(res.logits, ref, atol=1e-6)
    assert reopened.folder.damage(reopened.get("paris")) is None and f.is_file()  # rewritten in place
    again = make_store(path=tmp_path / "c").prefill("Q?", ["paris"])
    assert again.hit_tiers.get("disk") == 1 and torch.allclose(again.logits, ref, atol=1e-6)


@pytest.mark.parametrize("reopen", [False, True])
def test_re_adding_a_document_heals_its_damaged_file(tmp_path, reopen, caplog):
    store = make_store(path=tmp_path / "h")
    for k, v in DOCS.items():
        store.add(k, v)
    questions = [("Where?", ["paris", "rome"]), ("What?", ["rome", "tokyo", "paris"])]
    before = [store.prefill(q, ids, "S.").logits for q, ids in questions]
    f = _damage_one_byte(tmp_path / "h")
    damaged = next(d for d in DOCS if store.folder.file(store.get(d)) == f)
    if reopen:
        store = make_store(path=tmp_path / "h")
    with caplog.at_level("WARNING", logger="promptcache"):
        store.add(damaged, DOCS[damaged])  # the file is checked, found damaged, rewritten from the text
    assert f"document '{damaged}'" in caplog.text and "damaged" in caplog.text
    assert store.folder.damage(store.get(damaged)) is None
    for (q, ids), ref in zip(questions, before):
        assert torch.allclose(store.prefill(q, ids, "S.").logits, ref, atol=1e-6)
    fresh = make_store(path=tmp_path / "h")  # and after reopening: served from the healed file
    for (q, ids), ref in zip(questions, before):
        res = fresh.prefill(q, ids, "S.")
        assert "disk" in res.hit_tiers and torch.allclose(res.logits, ref, atol=1e-6)


def test_a_missing_document_file_is_rebuilt_from_the_indexed_text(tmp_path, caplog):
    store = make_store(path=tmp_path / "m")
    store.add("paris", DOCS["paris"])
    ref = store.prefill("Q?", ["paris"]).logits
    f = store.folder.file(store.get("paris"))
    f.unlink()
    with caplog.at_level("WARNING", logger="promptcache"):
        reopened = make_store(path=tmp_path / "m")  # opens: the text is in the index
    assert "missing" in caplog.text
    assert torch.allclose(reopened.prefill("Q?", ["paris"]).logits, ref, atol=1e-6)
    assert f.is_file() and reopened.folder.damage(reopened.get("paris")) is None


def test_learned_position_models_are_refused_for_independent_documents():
    for family in ("gpt2", "opt"):
        with pytest.raises(UnsupportedModelError, match="learned"):
            make_store(family, independent=True)
        make_store(family)  # chains move nothing: every family


INDEX_DAMAGE = [
    (lambda ix: [ix], "top level"),
    (lambda ix: {**ix, "documents": None}, "'documents'"),
    (lambda ix: {**ix, "model": None}, "'model'"),
    (lambda ix: {**ix, "tokenizer": 5}, "'tokenizer'"),
    (lambda ix: {**ix, "format_version": "2"}, "'format_version'"),
    (lambda ix: {**ix, "encode_prefix": "1 2"}, "'encode_prefix'"),
    (lambda ix: {**ix, "encode_prefix": [1, None]}, "'encode_prefix'"),
    (lambda ix: {**ix, "documents": [None]}, r"documents\[0\]"),
]
for _field in ("id", "text", "digest", "sha256", "file", "n_tokens", "metadata"):
    INDEX_DAMAGE.append((lambda ix, f=_field: {**ix, "documents": [{k: v for k, v in ix["documents"][0].items()
                                                                     if k != f}]}, rf"documents\[0\]\.{_field}"))
    INDEX_DAMAGE.append((lambda ix, f=_field: {**ix, "documents": [{**ix["documents"][0], f: None}]},
                         rf"documents\[0\]\.{_field}"))
INDEX_DAMAGE += [
    (lambda ix: {**ix, "documents": [{**ix["documents"][0], "n_tokens": "7"}]}, r"documents\[0\]\.n_tokens"),
    (lambda ix: {**ix, "documents": [{**ix["documents"][0], "metadata": []}]}, r"documents\[0\]\.metadata"),
    (lambda ix: {**ix, "documents": ix["documents"] * 2}, "repeats id"),
    (lambda ix: {**ix, "documents": [{**ix["documents"][0], "file": "../x.safetensors"}]}, "field 'file'"),
    (lambda ix: {**ix, "documents": [{**ix["documents"][0], "text": "other text"}]}, "tokenizes differently"),
]


@pytest.mark.parametrize("damage, field", INDEX_DAMAGE)
def test_damaged_index_is_a_clear_error_naming_file_and_field(tmp_path, damage, field):
    store = make_store(path=tmp_path / "d")
    store.add("paris", DOCS["paris"])
    index_file = tmp_path / "d" / "index.json"
    damaged = json.dumps(damage(json.loads(index_file.read_text())))
    index_file.write_text(damaged)
    before = sorted(p.name for p in (tmp_path / "d").rglob("*"))
    with pytest.raises(DocumentStoreError, match=field) as err:
        make_store(path=tmp_path / "d")
    assert "index.json" in str(err.value)
    assert sorted(p.name for p in (tmp_path / "d").rglob("*")) == before and index_file.read_text() == damaged


def test_documents_and_schema_modules_share_one_key_scheme():
    from promptcache.keys import alone_key

    store = make_store(independent=True, prefixed=False)  # encoded alone, keyed as a schema module is
    store.add("paris", DOCS["paris"])
    ids = store.pc.tok.encode(DOCS["paris"])
    key = alone_key(ids, store.pc.model_key, store.namespace)
    assert key in store.pc.store and torch.equal(store.pc.store.get(key)[0], store.pc.encode_span(ids))
    other = DocumentStore(store.pc, namespace="tenant-b", independent=True, prefixed=False)
    other.add("paris", DOCS["paris"])
    assert alone_key(ids, store.pc.model_key, "tenant-b") in store.pc.store and key != alone_key(
        ids, store.pc.model_key, "tenant-b")


def test_prefixed_documents_are_stored_apart_from_alone_ones_and_hold_the_prefixed_encoding():
    from promptcache.keys import alone_key

    store = make_store(prefixed=True)
    store.add("paris", DOCS["paris"])
    ids = store.pc.tok.encode(DOCS["paris"])
    anchor = list(store.encode_prefix)
    assert tuple(anchor) == tuple(store.layout("Q?", [], None).spans[0].token_ids)  # a system-less prefix
    assert alone_key(ids, store.pc.model_key, store.namespace) not in store.pc.store
    alone = DocumentStore(store.pc, prefixed=False)  # alone, from position 0
    alone.add("paris", DOCS["paris"])
    (kv, _), (kv_alone, _) = store.pc.store.get(store.state_key(ids)), alone.pc.store.get(alone.state_key(ids))
    assert torch.equal(kv, store.pc.encode_span(anchor + ids)[:, :, :, len(anchor):])
    assert torch.equal(kv_alone, store.pc.encode_span(ids)) and not torch.equal(kv, kv_alone)


def _doc_tokens(store, ids):
    return sum(len(store.get(d).token_ids) for d in ids)


@pytest.mark.parametrize("persisted", [False, True], ids=["memory", "folder"])
def test_first_question_after_add_reuses_every_document_in_any_order(tmp_path, persisted):
    store = make_store(path=tmp_path / "d" if persisted else None)  # the default mode
    assert store.mode == "reuse" and not store.exact
    for k, v in DOCS.items():
        store.add(k, v)
    for ids in (["rome", "paris"], ["tokyo", "rome", "paris"], ["paris", "rome"]):  # subsets, any order
        res = store.prefill("What is famous there?", ids, "S.")
        prefix = len(store.layout("What is famous there?", [], "S.").spans[0])
        assert res.cached_tokens == prefix + _doc_tokens(store, ids)  # every document from the cache
        assert res.hit_tiers == {FIRST_TIER: 1 + len(ids)} and not res.exact  # the prefix and each document
        assert 0 < res.recomputed_tokens < _doc_tokens(store, ids)  # "auto": a budget of their tokens
        assert res.reused_tokens == res.cached_tokens - res.recomputed_tokens
        assert res.new_tokens == sum(len(s) for s in res.layout.spans if s.kind == "new")  # separators, question


def test_a_reopened_default_store_serves_its_documents_from_disk_at_once(tmp_path):
    store = make_store(path=tmp_path / "d")
    for k, v in DOCS.items():
        store.add(k, v)
    ref = store.prefill("Where?", ["tokyo", "paris"], "S.")
    reopened = make_store(path=tmp_path / "d")  # a fresh engine: nothing in memory
    res = reopened.prefill("Where?", ["tokyo", "paris"], "S.")
    assert res.hit_tiers.get("disk") == 2  # both documents read back, none encoded again
    assert res.cached_tokens == ref.cached_tokens and res.recomputed_tokens == ref.recomputed_tokens
    assert torch.allclose(res.logits, ref.logits, atol=1e-5)


def test_learned_position_models_default_to_exact_chains():
    store = make_store("gpt2")
    assert store.mode == "exact"
    store.add("paris", DOCS["paris"])
    assert store.prefill("Q?", ["paris"]).exact


def test_the_shipped_rag_example_reuses_the_documents_on_its_first_run(tmp_path, capsys):
    import importlib.util
    import re
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "examples" / "rag.py"
    spec = importlib.util.spec_from_file_location("rag_example", path)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    for run, (encoded, served) in enumerate([(8, 0), (0, 8)]):  # a first run, then one over the same folder
        example.main(["--max-new-tokens", "2", "--store", str(tmp_path / "store")])
        out = capsys.readouterr().out
        assert f"{encoded} documents encoded and stored, {served} served" in out, run
        lines = re.findall(r"(\d+) of (\d+) prompt tokens reused from the cache, (\d+) of the documents", out)
        assert len(lines) == 3 and all(int(r) > int(n) // 2 and int(c) > 0 for r, n, c in lines), lines


def test_documents_encoded_after_the_prompts_own_prefix_make_the_first_document_exact():
    """``prefixed=SYSTEM``: each document is encoded after the prefix of a request with that system
    text; in such a prompt the first document sits where it was encoded (a plain prefill's states,
    not a recompute candidate), the others are moved and drifted."""
    system = "Answer briefly."
    store = make_store(prefixed=system)
    for k, v in DOCS.items():
        store.add(k, v)
    assert store.encode_prefix == store.layout("Q?", [], system).spans[0].token_ids  # the system prompt's prefix
    assert store.encode_prefix != make_store(prefixed=True).encode_prefix
    pc, question = store.pc, "What is famous there?"
    one = store.prefill(question, ["paris"], system, recompute=0)
    assert one.exact and one.recomputed_tokens == 0
    two = ["tokyo", "paris"]
    ids = list(store.layout(question, two, system).token_ids)
    approx, full = store.prefill(question, two, system, recompute=0), store.prefill(question, two, system, recompute=1.0)
    assert not approx.exact and full.recomputed_tokens == _doc_tokens(store, ["paris"])  # the first is not a candidate
    exact_store = DocumentStore(pc, exact=True)  # chains: a plain prefill of the same tokens
    for k, v in DOCS.items():
        exact_store.add(k, v)
    plain = exact_store.prefill(question, two, system)
    assert plain.exact and list(exact_store.layout(question, two, system).token_ids) == ids
    assert torch.max(torch.abs(full.logits - plain.logits)).item() <= 1e-4
    assert torch.max(torch.abs(one.logits - exact_store.prefill(question, ["paris"], system).logits)).item() <= 1e-4
    assert torch.max(torch.abs(approx.logits - plain.logits)).item() > 1e-4  # the second document drifted
    with pytest.raises(TypeError, match="prefixed"):
        make_store(prefixed=1)
