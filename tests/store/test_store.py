"""Compiled artifacts and tiered storage: round trip, mismatch, corruption, atomicity, budgets,
promotion, dedup, namespaces, concurrency."""

from __future__ import annotations

import concurrent.futures as cf
import json
import logging

import pytest
import torch

from promptcache import PMLError, PromptCache
from promptcache.engine import EngineConfig, StoreConfig
from promptcache.store import StoreError
from promptcache import artifact as artifact_mod
from promptcache import fsutil
from promptcache.artifact import ArtifactError
from tiny import make_model, make_tokenizer

SCHEMA = """<schema name="trip">
  <system>You are a travel planner.</system>
  <user>
    <module name="plan">Plan a trip of <parameter name="days" length="3"/> days.</module>
    <union scaffold="paris">
      <module name="paris">Paris is the capital of France, famous for museums.</module>
      <module name="tokyo">Tokyo is a huge city in Japan with temples.</module>
    </union>
    <module name="food">Highlight the food and the cafes.</module>
  </user>
</schema>"""
PROMPTS = ['<prompt schema="trip"><plan days="3"/><tokyo/><food/> Go.</prompt>',
           '<prompt schema="trip"><paris/> Quick answer.</prompt>',
           '<prompt schema="trip"><plan days="2"/><food/></prompt>']


def engine(config=None, seed=0, tokenizer=None):
    return PromptCache(make_model("llama", seed), tokenizer or make_tokenizer(), config)


@pytest.fixture(scope="module")
def reference():
    pc = engine()
    pc.add_schema(SCHEMA)
    return {p: pc.prefill(p).logits for p in PROMPTS}


def test_compile_load_round_trip_gives_identical_logits(tmp_path, reference):
    engine().compile(SCHEMA, tmp_path / "trip")
    manifest = json.loads((tmp_path / "trip" / "manifest.json").read_text())
    assert manifest["format_version"] == 2 and manifest["schema"]["name"] == "trip"
    assert manifest["model"]["architecture"] == "LlamaForCausalLM" and manifest["dtype"] == "float32"
    assert set(manifest["model"]) >= {"config_sha256", "weights_sha256"} and manifest["tokenizer"]["sha256"]
    fresh = engine()
    entry = fresh.load_compiled(tmp_path / "trip")
    assert entry.name == "trip"
    for p in PROMPTS:
        res = fresh.prefill(p)
        assert torch.equal(res.logits, reference[p])
    assert fresh.prefill(PROMPTS[0]).hit_tiers  # served from a tier


def test_first_use_reads_disk_then_memory(tmp_path):
    engine().compile(SCHEMA, tmp_path / "a")
    fresh = engine()
    fresh.load_compiled(tmp_path / "a")
    assert set(fresh.prefill(PROMPTS[1]).hit_tiers) == {"disk"}
    assert set(fresh.prefill(PROMPTS[1]).hit_tiers) == {"host"}  # promoted on use


@pytest.mark.parametrize("change, message", [
    ("weights", "model weights differ"),
    ("tokenizer", "tokenizer differs"),
    ("schema", "schema text differs"),
])
def test_mismatch_is_refused_naming_the_part(tmp_path, change, message, reference):
    src = tmp_path / "trip.xml"
    src.write_text(SCHEMA)
    engine().compile(src, tmp_path / "c")
    other = {"weights": lambda: engine(seed=1), "tokenizer": lambda: engine(tokenizer=make_tokenizer(chat=False)),
             "schema": engine}[change]()
    if change == "schema":
        src.write_text(SCHEMA.replace("cafes", "bakeries"))
    with pytest.raises(ArtifactError, match=message):
        other.load_compiled(tmp_path / "c", schema=src)
    if change != "schema":  # another model's or tokenizer's artifact is never recompiled in place
        before = {f.name: f.read_bytes() for f in (tmp_path / "c").iterdir()}
        with pytest.raises(ArtifactError, match="not recompiled in place"):
            other.load_compiled(tmp_path / "c", schema=src, recompile=True)
        assert {f.name: f.read_bytes() for f in (tmp_path / "c").iterdir()} == before
        return
    entry = other.load_compiled(tmp_path / "c", schema=src, recompile=True)  # the option to recompile
    assert entry.name == "trip"
    assert not artifact_mod.mismatches(json.loads((tmp_path / "c" / "manifest.json").read_text()),
                                       other.model_fingerprint, other.tokenizer_fingerprint, None)


def test_corrupted_states_are_detected_never_used(tmp_path, reference, caplog):
    engine().compile(SCHEMA, tmp_path / "d")
    manifest = json.loads((tmp_path / "d" / "manifest.json").read_text())
    states = tmp_path / "d" / manifest["states"]["file"]
    data = bytearray(states.read_bytes())
    data[-40] ^= 0xFF  # flip bits inside the last tensor's data
    states.write_bytes(bytes(data))
    fresh = engine()
    with pytest.raises(StoreError, match="checksum mismatch"):
        fresh.load_compiled(tmp_path / "d", verify=True)
    lazy = engine()
    lazy.load_compiled(tmp_path / "d")
    with caplog.at_level(logging.WARNING):  # caught at first read: re-encoded by the prompt, never used
        assert all(torch.equal(lazy.prefill(p).logits, reference[p]) for p in PROMPTS)
    assert "checksum mismatch" in caplog.text and "re-encoding" in caplog.text


def test_truncated_states_file_is_refused(tmp_path):
    engine().compile(SCHEMA, tmp_path / "t")
    manifest = json.loads((tmp_path / "t" / "manifest.json").read_text())
    states = tmp_path / "t" / manifest["states"]["file"]
    states.write_bytes(states.read_bytes()[: states.stat().st_size // 2])
    with pytest.raises(ArtifactError, match="truncated or corrupted"):
        engine().load_compiled(tmp_path / "t")


def test_crash_mid_write_leaves_the_old_artifact(tmp_path, monkeypatch, reference):
    out = tmp_path / "w"
    engine().compile(SCHEMA, out)
    before = sorted(p.name for p in out.iterdir())

    def dying_fsync(fd):
        raise KeyboardInterrupt  # the process dies after writing the temporary file, before the rename

    monkeypatch.setattr(fsutil.os, "fsync", dying_fsync)
    with pytest.raises(KeyboardInterrupt):
        engine(seed=1).compile(SCHEMA, out)
    monkeypatch.undo()
    assert sorted(p.name for p in out.iterdir()) == before  # no half file, old manifest and states
    fresh = engine()
    fresh.load_compiled(out)
    assert torch.equal(fresh.prefill(PROMPTS[0]).logits, reference[PROMPTS[0]])
    with pytest.raises(KeyboardInterrupt):
        monkeypatch.setattr(fsutil.os, "fsync", dying_fsync)
        engine().compile(SCHEMA, tmp_path / "new")
    monkeypatch.undo()
    assert not list((tmp_path / "new").glob("*.safetensors")) and not (tmp_path / "new" / "manifest.json").exists()
    with pytest.raises(ArtifactError, match="no manifest.json"):
        engine().load_compiled(tmp_path / "new")


def test_eviction_under_budget_stays_exact_and_within_budget(tmp_path, reference):
    full = engine()
    entry = full.add_schema(SCHEMA)
    budget = entry.stored_bytes // 3  # smaller than the working set
    small = engine(EngineConfig(store=StoreConfig(host_budget=budget, spill_dir=str(tmp_path / "spill"))))
    small.add_schema(SCHEMA)
    assert small.store.usage()["host"] <= budget
    assert small.store.usage()["disk"] > 0  # evicted states went down to disk
    for _ in range(2):
        for p in PROMPTS:
            assert torch.equal(small.prefill(p).logits, reference[p])
            assert small.store.usage()["host"] <= budget


def test_promotion_after_eviction(tmp_path):
    pc = engine(EngineConfig(store=StoreConfig(host_budget=0, spill_dir=str(tmp_path))))
    entry = pc.add_schema(SCHEMA)
    key = next(iter(entry.keys.values()))
    assert pc.store.tier_of(key) == "disk"
    roomy = engine(EngineConfig(store=StoreConfig(host_budget=10 * entry.stored_bytes, spill_dir=str(tmp_path / "s2"))))
    e2 = roomy.add_schema(SCHEMA)
    keys = list(e2.keys.values())
    roomy.store.tiers[0].budget = e2.stored_bytes // 4  # shrink: most states go down
    roomy.store.fit()
    down = [k for k in keys if roomy.store.tier_of(k) == "disk"]
    assert down
    res = roomy.prefill(PROMPTS[0])
    assert res.hit_tiers.get("disk", 0) > 0
    assert roomy.store.usage()["host"] <= roomy.store.tiers[0].budget


def test_identical_modules_are_stored_once():
    pc = engine()
    a = pc.add_schema(SCHEMA)
    used = pc.store.usage()["host"]
    b = pc.add_schema(SCHEMA.replace('name="trip"', 'name="trip2"'))  # same text, other schema name
    assert pc.store.usage()["host"] == used
    assert set(a.keys.values()) == set(b.keys.values())
    c = pc.add_schema(SCHEMA.replace("Highlight the food and the cafes.", "Only museums."))
    shared = set(a.keys.values()) & set(c.keys.values())
    assert shared and shared != set(a.keys.values())  # the prefix is shared, the changed module is not


def test_namespaces_never_share_states():
    pc = engine()
    a = pc.add_schema(SCHEMA, namespace="tenant-a")
    b = pc.add_schema(SCHEMA, namespace="tenant-b")
    assert not set(a.keys.values()) & set(b.keys.values())
    assert pc.store.usage()["host"] == a.stored_bytes + b.stored_bytes
    with pytest.raises(PMLError, match="namespace 'tenant-c'"):
        pc.prefill(PROMPTS[0], namespace="tenant-c")
    assert torch.equal(pc.prefill(PROMPTS[0], namespace="tenant-a").logits,
                       pc.prefill(PROMPTS[0], namespace="tenant-b").logits)


def test_concurrent_generate_under_eviction_is_exact(tmp_path):
    ref = engine()
    ref.add_schema(SCHEMA)
    expected = {p: ref.generate(p, max_new_tokens=5).token_ids for p in PROMPTS}
    pc = engine(EngineConfig(store=StoreConfig(host_budget=ref.schema("trip").stored_bytes // 2, spill_dir=str(tmp_path))))
    pc.add_schema(SCHEMA)
    with cf.ThreadPoolExecutor(4) as ex:
        results = list(ex.map(lambda p: (p, pc.generate(p, max_new_tokens=5).token_ids), PROMPTS * 5))
    for p, ids in results:
        assert ids == expected[p]


def test_edited_manifest_is_refused_and_recompiled_only_from_trusted_text(tmp_path, reference):
    engine().compile(SCHEMA, tmp_path / "e")
    mf = tmp_path / "e" / "manifest.json"
    data = json.loads(mf.read_text())
    data["kv_spec"]["head_dim"] += 1  # an edit no other check would notice: the manifest hash does
    mf.write_text(json.dumps(data))
    with pytest.raises(ArtifactError, match="edited or corrupted"):
        engine().load_compiled(tmp_path / "e")
    data["schema"]["text"] = data["schema"]["text"].replace("cafes", "bars")  # embedded text damaged too
    mf.write_text(json.dumps(data))
    with pytest.raises(ArtifactError, match="embedded schema text does not match"):
        engine().load_compiled(tmp_path / "e", recompile=True)
    src = tmp_path / "trip.xml"
    src.write_text(SCHEMA)
    pc = engine()
    pc.load_compiled(tmp_path / "e", schema=src, recompile=True)  # with the source: recompiled
    assert torch.equal(pc.prefill(PROMPTS[0]).logits, reference[PROMPTS[0]])
