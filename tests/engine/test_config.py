"""``EngineConfig`` by concern: sections validated on construction, no setting held twice, and the
flat spelling of before (keywords, attribute reads, ``recompute=0.2``) routed with a warning."""

from __future__ import annotations

import dataclasses

import pytest

from promptcache import EngineConfig, RecomputeConfig, RunnerConfig, StoreConfig
from promptcache.errors import ConfigError
from promptcache.settings import leaves


def test_nested_spelling_holds_each_setting_once():
    cfg = EngineConfig(runner=RunnerConfig(encode_chunk=64, packed_linear=True),
                       store=StoreConfig(host_budget=5, spill_dir="/tmp/s"),
                       recompute=RecomputeConfig(fraction=0.25, selection="qmatch"), namespace="t")
    assert [f.name for f in dataclasses.fields(cfg)] == ["runner", "store", "recompute", "namespace"]
    assert cfg.runner.encode_chunk == 64 and cfg.store.host_budget == 5 and cfg.recompute.fraction == 0.25
    names = [leaf.name for leaf in leaves(EngineConfig)]
    assert len(names) == len(set(names)) and "recompute" in names and "host_budget" in names
    assert EngineConfig() == EngineConfig() and hash(EngineConfig()) == hash(EngineConfig())


@pytest.mark.parametrize("make, where", [
    (lambda: RunnerConfig(encode_chunk=0), "RunnerConfig.encode_chunk"),
    (lambda: RunnerConfig(kv_dtype="int3"), "RunnerConfig.kv_dtype"),
    (lambda: StoreConfig(disk_budget=-1), "StoreConfig.disk_budget"),
    (lambda: StoreConfig(remote="http://cache:6379"), "StoreConfig.remote"),
    (lambda: StoreConfig(disk_policy="sometimes"), "StoreConfig.disk_policy"),
    (lambda: RecomputeConfig(fraction=1.5), "RecomputeConfig.fraction"),
    (lambda: RecomputeConfig(selection="nope"), "unknown recompute selection 'nope'"),
    (lambda: EngineConfig(store=RunnerConfig()), "EngineConfig.store must be a StoreConfig"),
    (lambda: EngineConfig(namespace="a b"), "bad namespace"),
])
def test_every_section_validates_itself(make, where):
    with pytest.raises(ConfigError, match=where):
        make()


def test_flat_keywords_are_routed_with_a_warning_naming_the_new_spelling():
    with pytest.warns(DeprecationWarning, match=r"write EngineConfig\(store=StoreConfig\(host_budget=\.\.\.\), "
                                                r"runner=RunnerConfig\(packed_linear=\.\.\.\)"):
        cfg = EngineConfig(host_budget=123, packed_linear=True, recompute_selection="qmatch", namespace="n")
    assert cfg.store.host_budget == 123 and cfg.runner.packed_linear is True
    assert cfg.recompute == RecomputeConfig(selection="qmatch") and cfg.namespace == "n"
    with pytest.warns(DeprecationWarning, match=r"recompute=RecomputeConfig\(fraction=\.\.\.\)"):
        old = EngineConfig(recompute=0.2)
    assert old.recompute.fraction == 0.2 and isinstance(old.recompute, RecomputeConfig)
    with pytest.warns(DeprecationWarning):
        assert EngineConfig(recompute=" Auto ").recompute.fraction == "auto"
    with pytest.warns(DeprecationWarning), pytest.raises(ConfigError, match="RecomputeConfig.fraction"):
        EngineConfig(recompute=2.0)
    with pytest.raises(TypeError, match="host_budjet"):
        EngineConfig(host_budjet=1)


def test_a_flat_keyword_beside_its_section_changes_that_section():
    with pytest.warns(DeprecationWarning):
        cfg = EngineConfig(store=StoreConfig(spill_dir="/tmp/x"), host_budget=7)
    assert cfg.store == StoreConfig(spill_dir="/tmp/x", host_budget=7)


def test_flat_reads_warn_and_read_the_section():
    cfg = EngineConfig(runner=RunnerConfig(encode_chunk=99), store=StoreConfig(host_budget=3))
    with pytest.warns(DeprecationWarning, match=r"EngineConfig.host_budget is deprecated: read config.store.host_budget"):
        assert cfg.host_budget == 3
    with pytest.warns(DeprecationWarning, match="config.runner.encode_chunk"):
        assert cfg.encode_chunk == 99
    with pytest.warns(DeprecationWarning, match="config.recompute_selection|config.recompute.selection"):
        assert cfg.recompute_selection == "qmatch"
    # ``recompute`` is the section now; the old reading (a fraction or "auto") still compares
    with pytest.warns(DeprecationWarning, match="compare config.recompute.fraction"):
        assert cfg.recompute == "auto"
    with pytest.warns(DeprecationWarning):
        assert EngineConfig(recompute=RecomputeConfig(fraction=0.3)).recompute == 0.3
    with pytest.warns(DeprecationWarning, match="read config.store"):
        assert cfg.store_config() is cfg.store


def test_dataclasses_replace_on_sections_and_on_flat_names():
    cfg = EngineConfig(store=StoreConfig(host_budget=1))
    new = dataclasses.replace(cfg, store=dataclasses.replace(cfg.store, disk_budget=9), namespace="b")
    assert new.store == StoreConfig(host_budget=1, disk_budget=9) and new.namespace == "b" and cfg.store.disk_budget is None
    with pytest.warns(DeprecationWarning):
        flat = dataclasses.replace(cfg, kv_dtype="bfloat16")
    assert flat.runner.kv_dtype == "bfloat16" and flat.store == cfg.store
