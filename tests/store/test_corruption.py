"""Damaged artifacts and document stores: every load gives the good logits or a clear refusal,
and after a refusal the good artifact loads and answers correctly in the same engine. A state
that fails its checksum at first read is dropped and re-encoded by the prompt that read it
("repaired": the good logits, with a warning), never used.

Coverage (issue "hardening", integrity): every single-byte flip of the states file's header,
the first and last 64 data bytes and a strided sample of the rest; flips of the manifest;
truncations; another schema's and another model's states files (with their manifest entries)
swapped in; the same for a DocumentStore folder.
"""

from __future__ import annotations

import json
import logging
import shutil
import struct

import pytest
import torch

from promptcache import PromptCache
from promptcache.artifact import ArtifactError
from promptcache.rag import DocumentStore, DocumentStoreError
from promptcache.store import StoreError
from tiny import make_model, make_tokenizer

SCHEMA = """<schema name="c"><system>Be brief.</system><user>
  <module name="a">Paris has museums.</module><module name="b">Tokyo has temples.</module>
</user></schema>"""
OTHER = SCHEMA.replace('name="c"', 'name="c"').replace("temples", "gardens and trains")
PROMPTS = ['<prompt schema="c"><a/><b/> Where?</prompt>', '<prompt schema="c"><b/></prompt>']
REFUSED = (ArtifactError, StoreError)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("corrupt")
    pc = PromptCache(make_model("llama", 0), make_tokenizer())
    pc.compile(SCHEMA, root / "good")
    encode, pc.encodes = pc.encoder.encode, []
    pc.encoder.encode = lambda *a, **k: pc.encodes.append(1) or encode(*a, **k)  # counts re-encodings
    PromptCache(make_model("llama", 0), make_tokenizer()).compile(OTHER, root / "other")
    PromptCache(make_model("llama", 1), make_tokenizer()).compile(SCHEMA, root / "othermodel")
    ref = PromptCache(make_model("llama", 0), make_tokenizer())
    ref.add_schema(SCHEMA)
    good = {p: ref.prefill(p).logits for p in PROMPTS}
    return pc, root, good


def states_of(folder):
    return folder / json.loads((folder / "manifest.json").read_text())["states"]["file"]


def outcome(pc, folder, good):
    """'same' (identical logits), 'repaired' (identical logits after a state that failed its
    checksum was re-encoded) or 'refused'; anything else fails the test."""
    before = len(pc.encodes)
    try:
        pc.load_compiled(folder)
        for p in PROMPTS:
            if not torch.equal(pc.prefill(p).logits, good[p]):
                return "WRONG"
        return "same" if len(pc.encodes) == before else "repaired"
    except REFUSED:
        return "refused"


def recovers(pc, root, good):
    pc.load_compiled(root / "good")
    return all(torch.equal(pc.prefill(p).logits, good[p]) for p in PROMPTS)


def test_every_header_byte_and_sampled_data_bytes(setup, tmp_path):
    pc, root, good = setup
    bad = tmp_path / "bad"
    shutil.copytree(root / "good", bad)
    f = states_of(bad)
    clean = f.read_bytes()
    header_end = 8 + struct.unpack("<Q", clean[:8])[0]
    data = range(header_end, len(clean))
    offsets = list(range(header_end)) + list(data[:64]) + list(data[-64:]) + list(data[64:-64:97])
    results = {}
    for off in offsets:
        for mask in (0xFF, 0x01):
            buf = bytearray(clean)
            buf[off] ^= mask
            f.write_bytes(bytes(buf))
            results[(off, mask)] = outcome(pc, bad, good)
    f.write_bytes(clean)
    assert "WRONG" not in results.values(), [k for k, v in results.items() if v == "WRONG"][:5]
    assert sum(v in ("refused", "repaired") for v in results.values()) > 0.9 * len(results)
    assert all(results[(off, 0xFF)] == "repaired" for off in data[:64])  # data flips are always caught
    assert recovers(pc, root, good)


def test_manifest_flips_truncations_and_swaps(setup, tmp_path):
    pc, root, good = setup
    seen = []

    def case(name, mutate, check_recovery=True):
        folder = tmp_path / name
        shutil.copytree(root / "good", folder)
        mutate(folder)
        got = outcome(pc, folder, good)
        seen.append((name, got))
        assert got != "WRONG", name
        if check_recovery:
            assert recovers(pc, root, good), f"after {name} the good artifact no longer loads"

    mtext = (root / "good" / "manifest.json").read_bytes()
    for n, off in enumerate(range(0, len(mtext), max(1, len(mtext) // 120))):
        case(f"manifest-{off}", lambda d, off=off: (d / "manifest.json").write_bytes(
            mtext[:off] + bytes([mtext[off] ^ 0x01]) + mtext[off + 1 :]), check_recovery=n % 20 == 0)
    assert recovers(pc, root, good)
    size = states_of(root / "good").stat().st_size
    for cut in (0, 7, 8, 100, size // 2, size - 1):
        case(f"truncate-{cut}", lambda d, cut=cut: states_of(d).write_bytes(states_of(d).read_bytes()[:cut]))

    def swap_states(src):
        def mutate(d):
            other = states_of(root / src)
            states_of(d).write_bytes(other.read_bytes())  # another file under this artifact's name
        return mutate

    def swap_with_entries(src):
        def mutate(d):  # another artifact's states file *and* its sha256 entries in this manifest
            m = json.loads((d / "manifest.json").read_text())
            om = json.loads((root / src / "manifest.json").read_text())
            shutil.copy(states_of(root / src), d / om["states"]["file"])
            m["states"] = om["states"]
            (d / "manifest.json").write_text(json.dumps(m))
        return mutate

    for src in ("other", "othermodel"):
        case(f"swap-file-{src}", swap_states(src))
        case(f"swap-entries-{src}", swap_with_entries(src))
    case("manifest-from-othermodel", lambda d: shutil.copy(root / "othermodel" / "manifest.json", d / "manifest.json"))
    refused = {n for n, g in seen if g == "refused"}
    assert {"swap-file-other", "swap-file-othermodel", "swap-entries-othermodel", "truncate-100"} <= refused
    assert "swap-entries-other" in refused  # same model, other schema: manifest hash and keys differ


def test_poisoned_state_is_dropped_and_reencoded(setup, tmp_path, caplog):
    pc0, root, good = setup
    pc = PromptCache(make_model("llama", 0), make_tokenizer())
    bad = tmp_path / "bad"
    shutil.copytree(root / "good", bad)
    f = states_of(bad)
    buf = bytearray(f.read_bytes())
    buf[-5] ^= 0xFF
    f.write_bytes(bytes(buf))
    pc.load_compiled(bad)
    with caplog.at_level(logging.WARNING):
        assert all(torch.equal(pc.prefill(p).logits, good[p]) for p in PROMPTS)  # re-encoded, never used
    assert "checksum mismatch" in caplog.text and "re-encoding" in caplog.text
    pc.add_schema(SCHEMA)  # nothing left to encode
    assert all(torch.equal(pc.prefill(p).logits, good[p]) for p in PROMPTS)
    assert recovers(pc, root, good)


DOCS = {"paris": "Paris is the capital of France, famous for museums.", "rome": "Rome is old and has gardens."}


def test_document_store_corruption_is_never_used_and_healed(tmp_path):
    pc = PromptCache(make_model("llama", 0), make_tokenizer())
    store = DocumentStore(pc, tmp_path / "d", independent=True)
    for k, v in DOCS.items():
        store.add(k, v)
    ref = store.prefill("Q?", ["paris", "rome"], "S.").logits
    f = next((tmp_path / "d" / "docs").glob("*.safetensors"))
    clean = f.read_bytes()
    header_end = 8 + struct.unpack("<Q", clean[:8])[0]
    results = []
    fresh = PromptCache(make_model("llama", 0), make_tokenizer())
    for off in list(range(0, header_end, 3)) + list(range(header_end, len(clean), 211)) + [len(clean) - 1]:
        buf = bytearray(clean)
        buf[off] ^= 0xFF
        f.write_bytes(bytes(buf))
        try:  # opening registers the file again: a copy healed before in memory does not shadow it
            res = DocumentStore(fresh, tmp_path / "d", independent=True).prefill("Q?", ["paris", "rome"], "S.")
            results.append("same" if torch.allclose(res.logits, ref, atol=1e-6) else "WRONG")
        except (StoreError, DocumentStoreError):
            results.append("refused")
    # every damage is found and never used: the document is encoded again from its text, its file rewritten
    assert results.count("same") == len(results), results
    reopened = DocumentStore(fresh, tmp_path / "d", independent=True)
    assert all(reopened.folder.damage(reopened.get(k)) is None for k in DOCS)
    third = PromptCache(make_model("llama", 0), make_tokenizer())
    res = DocumentStore(third, tmp_path / "d", independent=True).prefill("Q?", ["paris", "rome"], "S.")
    assert torch.allclose(res.logits, ref, atol=1e-6) and "disk" in res.hit_tiers  # the file was rewritten


def _paths(value, path=(), depth=0):
    """Every key path of a manifest down to ``depth`` 4 (lists: their first item)."""
    yield path
    if depth < 4 and isinstance(value, dict):
        for k, v in value.items():
            yield from _paths(v, path + (k,), depth + 1)
    elif depth < 4 and isinstance(value, list) and value:
        yield from _paths(value[0], path + (0,), depth + 1)


def test_absurd_manifest_structure_is_refused_as_artifact_error(setup, tmp_path):
    """Deep nesting and every field given a value of the wrong type: an ArtifactError (or the
    good logits where the value is never read), never a RecursionError, TypeError or KeyError."""
    pc, root, good = setup
    clean = json.loads((root / "good" / "manifest.json").read_text())
    deep = "[" * 100_000 + "]" * 100_000
    folder = tmp_path / "deep"
    shutil.copytree(root / "good", folder)
    (folder / "manifest.json").write_text(deep)
    with pytest.raises(ArtifactError, match="nested deeper"):
        pc.load_compiled(folder)
    seen = {}
    for path in list(_paths(clean))[1:]:
        for wrong in (None, 7, "x", [], {}, json.loads("[" * 500 + "]" * 500)):
            m = json.loads(json.dumps(clean))
            target = m
            for k in path[:-1]:
                target = target[k]
            target[path[-1]] = wrong
            (folder / "manifest.json").write_text(json.dumps(m))
            seen[(path, type(wrong).__name__)] = outcome(pc, folder, good)
    assert set(seen.values()) <= {"refused", "same"}, {k: v for k, v in seen.items() if v not in ("refused", "same")}
    assert list(seen.values()).count("refused") > 0.9 * len(seen)
    assert recovers(pc, root, good)
