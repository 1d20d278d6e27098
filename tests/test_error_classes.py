"""One error base class (issue 16): every exception class promptcache defines derives from
``PromptCacheError`` and says its exit code (1 bad input, 2 environment); old bases still hold."""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import pkgutil
import subprocess
import sys
from pathlib import Path

import pytest

import promptcache
from promptcache import ConfigError, PMLError, PromptCacheError

ROOT = Path(__file__).resolve().parents[1]
ENVIRONMENT = {"SourceFileError", "ModelNotFoundError", "OfflineError", "DeviceError", "QueueFull", "EnvironmentProblem",
               "FolderBusy", "SpillFolderBusy", "PinBudgetError", "PoolFull",
               "PackageFetchError", "BuildBusy"}  # PackageFetchError: the package index cannot be reached  # PinBudgetError, PoolFull: capacity, like QueueFull

NEEDS = {"promptcache.integrations.vllm.connector": "vllm"}  # loaded by vLLM itself: imports vllm, no extra of ours


def defined_exceptions() -> dict[str, type]:
    found = {}
    for info in pkgutil.walk_packages(promptcache.__path__, "promptcache."):
        if info.name.endswith("__main__"):
            continue
        if info.name in NEEDS and importlib.util.find_spec(NEEDS[info.name]) is None:
            continue
        module = importlib.import_module(info.name)
        for name, obj in vars(module).items():
            if inspect.isclass(obj) and issubclass(obj, BaseException) and obj.__module__ == info.name:
                if name.startswith("_"):  # a private control-flow signal, caught in its own module
                    assert f"except {name}" in Path(module.__file__).read_text(), f"{info.name}.{name} is never caught"
                    continue
                found[f"{info.name}.{name}"] = obj
    return found


def test_every_promptcache_exception_derives_from_the_base_and_has_an_exit_code():
    found = defined_exceptions()
    names = {cls.__name__ for cls in found.values()}
    assert {"PMLError", "ArtifactError", "StoreError", "CodecError", "UnsupportedModelError", "DocumentStoreError",
            "UnknownDocumentError", "APIError", "ConfigError", "OfflineError", "DeviceError"} <= names
    for where, cls in found.items():
        assert issubclass(cls, PromptCacheError), where
        assert cls.exit_code == (2 if cls.__name__ in ENVIRONMENT else 1), where


def test_old_bases_still_hold():
    from promptcache.artifact import ArtifactError
    from promptcache.errors import ModelNotFoundError
    from promptcache.models import UnsupportedModelError
    from promptcache.rag import UnknownDocumentError
    from promptcache.store.codec import CodecError

    assert issubclass(PMLError, ValueError) and issubclass(ConfigError, ValueError)
    assert issubclass(UnsupportedModelError, ValueError) and issubclass(ArtifactError, RuntimeError)
    assert issubclass(CodecError, RuntimeError) and issubclass(UnknownDocumentError, KeyError)
    assert issubclass(ModelNotFoundError, OSError)


def test_bad_settings_are_config_errors():
    from promptcache import EngineConfig, RecomputeConfig, RunnerConfig, SamplingParams, StoreConfig

    for make in (lambda: RunnerConfig(encode_chunk=0), lambda: EngineConfig(namespace=""),
                 lambda: EngineConfig(namespace="a b"), lambda: RecomputeConfig(fraction=2.0),
                 lambda: RunnerConfig(kv_dtype="int3"), lambda: StoreConfig(remote="http://x"),
                 lambda: EngineConfig(store=RunnerConfig())):
        with pytest.raises(ConfigError):
            make()
    with pytest.raises(ConfigError, match="SamplingParams.temperature"):
        SamplingParams(temperature=-1.0)
    with pytest.raises(ConfigError, match="StoreConfig.host_budget"):
        StoreConfig(host_budget=-1)
    with pytest.raises(ConfigError, match="bad namespace"):
        EngineConfig().namespace_for("")


def test_the_error_module_needs_no_torch():
    code = "import sys, promptcache.errors, promptcache; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT, env={"PYTHONPATH": str(ROOT)})
