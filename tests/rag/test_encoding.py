"""Where a DocumentStore encodes its documents: by default after the prefix of a request with the
store's ``system`` text (issue 51); ``prefixed=False`` alone from position 0; a folder records its
encoding, a default store reopens it with that encoding, an explicit other one is refused (or
re-encoded with ``reencode=True``), and a failed re-encoding leaves the folder's index whole."""

from __future__ import annotations

import json
import logging

import pytest
import torch

from promptcache import PromptCache
from promptcache.rag import DocumentStore, DocumentStoreError
from promptcache.rag.folder import DocumentFolder
from tiny import make_model, make_tokenizer

DOCS = {
    "paris": "Paris is the capital of France, famous for museums and cafes.",
    "tokyo": "Tokyo is a huge city in Japan with temples, food markets and fast trains.",
}
SYS, Q, TOL = "Answer briefly.", "What is famous there?", 1e-4


def engine():
    return PromptCache(make_model("llama", 0), make_tokenizer())


def filled(store):
    for k, v in DOCS.items():
        store.add(k, v)
    return store


def test_the_default_encodes_documents_after_the_prefix_of_a_request_with_the_stores_system_text():
    pc = engine()
    plain = DocumentStore(pc)  # no system text: after a system-less request's prefix
    assert plain.system is None and plain.encode_prefix == plain.layout(Q, []).spans[0].token_ids
    assert plain.encode_prefix == DocumentStore(pc, prefixed=True).encode_prefix
    store = filled(DocumentStore(pc, system=SYS))
    assert store.encode_prefix == store.layout(Q, [], SYS).spans[0].token_ids != plain.encode_prefix
    assert store.layout(Q, ["paris"]).token_ids == store.layout(Q, ["paris"], SYS).token_ids  # its system by default
    assert DocumentStore(pc, system=SYS, prefixed=True).encode_prefix == store.encode_prefix
    exact = filled(DocumentStore(pc, exact=True))  # chains: a plain prefill of the same tokens
    one = store.prefill(Q, ["paris"], recompute=0)  # the first document sits where it was encoded
    assert one.exact and one.recomputed_tokens == 0
    assert torch.max(torch.abs(one.logits - exact.prefill(Q, ["paris"], SYS).logits)).item() <= TOL
    two = store.prefill(Q, ["paris", "tokyo"], recompute=0.5)  # only the second is drifted and recomputed
    assert not two.exact and 0 < two.recomputed_tokens <= len(store.get("tokyo").token_ids)
    other = store.prefill(Q, ["paris"], "Be kind.", recompute=0)  # another system text: approximate
    assert not other.exact
    none = store.prefill(Q, ["paris"], "", recompute=0)  # "": a request without any system text
    assert none.layout.spans[0].token_ids == plain.encode_prefix and not none.exact
    gen = store.generate(Q, ["paris"], max_new_tokens=4)  # the serving path: the store's system, exact
    assert gen.exact and gen.cached_tokens + gen.new_tokens == len(store.layout(Q, ["paris"], SYS).token_ids)


def test_prefixed_false_keeps_the_old_encoding_and_a_system_text_wins_as_prefixed():
    pc = engine()
    alone = filled(DocumentStore(pc, system=SYS, prefixed=False))
    assert alone.encode_prefix == () and not alone.prefill(Q, ["paris"], recompute=0).exact
    ids = pc.tok.encode(DOCS["paris"])
    assert torch.equal(pc.store.get(alone.state_key(ids))[0], pc.encode_span(ids))
    named = DocumentStore(pc, system="Be kind.", prefixed=SYS)  # the string names the encoding
    assert named.encode_prefix == DocumentStore(pc, system=SYS).encode_prefix and named.system == "Be kind."


@pytest.mark.parametrize("kw, error, match", [
    (dict(prefixed=1), TypeError, "prefixed must be"),
    (dict(system=3), TypeError, "system must be"),
    (dict(prefixed=""), ValueError, "names no system text"),
    (dict(attach_separator=True, prefixed=True), ValueError, "attach_separator=True"),
    (dict(attach_separator=True, prefixed=SYS), ValueError, "attach_separator=True"),
])
def test_contradictory_or_wrong_options_are_refused(kw, error, match):
    with pytest.raises(error, match=match):
        DocumentStore(engine(), **kw)


def test_attach_separator_keeps_units_encoded_alone_with_a_system_text_for_requests():
    store = DocumentStore(engine(), independent=True, attach_separator=True, system=SYS)
    assert store.encode_prefix == () and store.layout(Q, []).spans[0].token_ids == store.layout(Q, [], SYS).spans[0].token_ids
    assert DocumentStore(store.pc, attach_separator=True, prefixed=False).encode_prefix == ()


def test_an_old_alone_folder_reopened_with_the_default_keeps_its_encoding(tmp_path, caplog):
    old = filled(DocumentStore(engine(), tmp_path / "d", prefixed=False))
    ref = old.prefill(Q, ["tokyo", "paris"], SYS, recompute=0)
    index = json.loads((tmp_path / "d" / "index.json").read_text())
    assert index["encode_prefix"] == []
    del index["encode_prefix"]  # a folder written before the field: its documents were encoded alone
    (tmp_path / "d" / "index.json").write_text(json.dumps(index))
    with caplog.at_level(logging.INFO, logger="promptcache.rag.store"):
        reopened = DocumentStore(engine(), tmp_path / "d")  # the default
    assert reopened.encode_prefix == () and reopened.ids() == ["paris", "tokyo"]
    assert any("alone from position 0" in r.getMessage() and "the folder's setting" in r.getMessage()
               for r in caplog.records)
    res = reopened.prefill(Q, ["tokyo", "paris"], SYS, recompute=0)
    assert res.hit_tiers.get("disk") == 2  # read back, not encoded again
    assert torch.max(torch.abs(res.logits - ref.logits)).item() <= TOL
    # a prefixed folder reopened with the default: the prefix it records, also with no system text given
    filled(DocumentStore(engine(), tmp_path / "p", system=SYS))
    again = DocumentStore(engine(), tmp_path / "p")
    assert again.encode_prefix == again.layout(Q, [], SYS).spans[0].token_ids and again.system is None
    assert again.prefill(Q, ["paris"], SYS, recompute=0).exact


@pytest.mark.parametrize("built, asked, held, wanted", [
    (dict(), dict(prefixed=False), "after a", "alone from position 0"),
    (dict(), dict(system=SYS), "after a", "after a"),
    (dict(prefixed=False), dict(prefixed=True), "alone from position 0", "after a"),
    (dict(prefixed=False), dict(system=SYS), "alone from position 0", "after a"),
])
def test_an_explicit_other_encoding_is_refused_naming_the_folder_and_changes_nothing(tmp_path, built, asked, held,
                                                                                      wanted):
    filled(DocumentStore(engine(), tmp_path / "d", **built))
    before = {p.name: p.read_bytes() for p in (tmp_path / "d").rglob("*") if p.is_file()}
    with pytest.raises(DocumentStoreError) as e:
        DocumentStore(engine(), tmp_path / "d", **asked)
    msg = str(e.value)
    assert str(tmp_path / "d") in msg and "reencode=True" in msg
    assert f"its documents were encoded {held}" in msg and f"this store asks for them encoded {wanted}" in msg
    assert {p.name: p.read_bytes() for p in (tmp_path / "d").rglob("*") if p.is_file()} == before


def test_reencode_rewrites_the_folder_in_the_asked_encoding(tmp_path):
    filled(DocumentStore(engine(), tmp_path / "d", prefixed=False))
    again = DocumentStore(engine(), tmp_path / "d", reencode=True, system=SYS)
    assert again.ids() == ["paris", "tokyo"] and again.encode_prefix == again.layout(Q, [], SYS).spans[0].token_ids
    assert json.loads((tmp_path / "d" / "index.json").read_text())["encode_prefix"] == list(again.encode_prefix)
    ref = again.prefill(Q, ["paris", "tokyo"], recompute=0)
    reopened = DocumentStore(engine(), tmp_path / "d")  # the default: the encoding the folder now records
    res = reopened.prefill(Q, ["paris", "tokyo"], SYS, recompute=0)
    assert res.hit_tiers.get("disk") == 2 and res.exact is False
    assert torch.max(torch.abs(res.logits - ref.logits)).item() <= TOL
    assert reopened.prefill(Q, ["paris"], SYS, recompute=0).exact  # the rewritten file holds the prefixed states


def test_a_reencode_that_fails_midway_leaves_the_old_index_whole(tmp_path, monkeypatch):
    filled(DocumentStore(engine(), tmp_path / "d", prefixed=False))
    index = (tmp_path / "d" / "index.json").read_bytes()
    ref = DocumentStore(engine(), tmp_path / "d").prefill(Q, ["paris", "tokyo"], SYS, recompute=0)
    written = []
    real = DocumentFolder.write_states

    def fail_second(self, doc, kv):
        if written:
            raise OSError("disk full")
        written.append(doc.id)
        real(self, doc, kv)

    monkeypatch.setattr(DocumentFolder, "write_states", fail_second)
    with pytest.raises(OSError, match="disk full"):
        DocumentStore(engine(), tmp_path / "d", reencode=True, prefixed=True)
    monkeypatch.undo()
    assert written and (tmp_path / "d" / "index.json").read_bytes() == index  # the old index, every document
    reopened = DocumentStore(engine(), tmp_path / "d")  # its encoding: alone; the rewritten file is healed
    assert reopened.encode_prefix == () and reopened.ids() == ["paris", "tokyo"]
    res = reopened.prefill(Q, ["paris", "tokyo"], SYS, recompute=0)
    assert torch.max(torch.abs(res.logits - ref.logits)).item() <= TOL


def test_a_request_with_another_prefix_than_the_encodings_is_logged_once(caplog):
    pc = engine()
    store = filled(DocumentStore(pc, system=SYS))
    with caplog.at_level(logging.WARNING, logger="promptcache.rag.store"):
        store.prefill(Q, ["paris"], recompute=0)  # the store's own system text: nothing to say
        store.prefill(Q, ["paris"], SYS, recompute=0)
        assert not caplog.records
        store.prefill(Q, ["paris"], "Be kind.", recompute=0)
        store.prefill(Q, ["tokyo"], "", recompute=0)
    warned = [r for r in caplog.records if "DocumentStore(..., system=...)" in r.getMessage()]
    assert len(warned) == 1 and "'Be kind.'" in warned[0].getMessage()
    with caplog.at_level(logging.WARNING, logger="promptcache.rag.store"):
        caplog.clear()
        alone = filled(DocumentStore(engine(), prefixed=False))  # encoded alone: no prefix to match
        alone.prefill(Q, ["paris"], "Be kind.", recompute=0)
    assert not caplog.records
