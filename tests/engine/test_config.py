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


def test_a_flat_keyword_is_a_type_error_naming_the_section_that_owns_it():
    with pytest.raises(TypeError, match=r"host_budget is StoreConfig.host_budget: "
                                        r"EngineConfig\(store=StoreConfig\(host_budget=\.\.\.\)\)"):
        EngineConfig(host_budget=123)
    with pytest.raises(TypeError, match=r"packed_linear is RunnerConfig.packed_linear"):
        EngineConfig(packed_linear=True, namespace="n")
    with pytest.raises(TypeError, match="host_budjet"):
        EngineConfig(host_budjet=1)
    with pytest.raises(ConfigError, match=r"EngineConfig.recompute must be a RecomputeConfig, got float 0.2 "
                                          r"\(write RecomputeConfig\(fraction=0.2\)\)"):
        EngineConfig(recompute=0.2)
    cfg = EngineConfig(runner=RunnerConfig(encode_chunk=99))
    assert not hasattr(cfg, "encode_chunk") and not hasattr(cfg, "store_config")  # read in the section


def test_recompute_config_compares_as_a_config():
    assert EngineConfig().recompute == RecomputeConfig() and RecomputeConfig() != "auto"
    assert RecomputeConfig(fraction=0.3) != 0.3 and RecomputeConfig(fraction=0.3).fraction == 0.3
    assert len({RecomputeConfig(), RecomputeConfig(fraction="auto")}) == 1  # hashable, by value


def test_dataclasses_replace_on_sections():
    cfg = EngineConfig(store=StoreConfig(host_budget=1))
    new = dataclasses.replace(cfg, store=dataclasses.replace(cfg.store, disk_budget=9), namespace="b")
    assert new.store == StoreConfig(host_budget=1, disk_budget=9) and new.namespace == "b" and cfg.store.disk_budget is None
