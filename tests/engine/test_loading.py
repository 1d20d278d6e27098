"""Model checks come before any weight is loaded (issue 16): dtype, device, offline, model type."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, GPTJConfig

from promptcache import ConfigError, PromptCache, PromptCacheError
from promptcache.errors import DeviceError, ModelNotFoundError, OfflineError
from promptcache.models import UnsupportedModelError, adapter_class
from promptcache.models import loading
from tiny import make_model


@pytest.fixture
def no_weights(monkeypatch):
    """Loading weights fails the test: every refusal here must come before them."""

    def refuse(*a, **k):
        raise AssertionError("weights were loaded before the refusal")

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", refuse)
    monkeypatch.setattr("transformers.AutoTokenizer.from_pretrained", refuse)


@pytest.fixture
def offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", True)  # read at import: set it too


def test_unsupported_model_type_is_refused_from_the_config_alone(tmp_path, no_weights):
    GPTJConfig(n_embd=32, n_layer=1, n_head=2, vocab_size=64).save_pretrained(tmp_path)
    with pytest.raises(UnsupportedModelError, match="model type 'gptj' is not supported .*llama") as e:
        PromptCache.from_pretrained(tmp_path)
    assert isinstance(e.value, PromptCacheError) and e.value.exit_code == 1


def test_adapter_class_needs_only_the_config():
    model = make_model("qwen2")
    assert adapter_class(model.config).__name__ == "LlamaFamily"
    with pytest.raises(UnsupportedModelError):
        adapter_class(GPTJConfig())


def test_offline_hub_id_fails_at_once_naming_the_alternatives(offline, no_weights):
    with pytest.raises(OfflineError) as e:
        PromptCache.from_pretrained("no-such-org/no-such-model")
    msg = str(e.value)
    assert "offline" in msg and "local directory" in msg and "'embedded'" in msg and "'smollm2'" in msg
    assert isinstance(e.value, OSError) and e.value.exit_code == 2


def test_unreachable_hub_is_offline_without_waiting_for_retries(monkeypatch, no_weights):
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", False)
    for var in loading._PROXY_VARS:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr("huggingface_hub.constants.ENDPOINT", "https://promptcache-no-such-host.invalid")
    calls = []
    monkeypatch.setattr("transformers.AutoConfig.from_pretrained",
                        lambda name, **kw: calls.append(kw) or (_ for _ in ()).throw(OSError("not cached")))
    with pytest.raises(OfflineError, match="cannot reach the hub"):
        loading.load_model("no-such-org/no-such-model")
    assert calls == [{"local_files_only": True}]  # only the local cache was asked, never the network


def test_a_missing_local_directory_config_is_named(tmp_path, no_weights):
    with pytest.raises(ModelNotFoundError, match=f"local directory '{tmp_path}' has no usable config.json"):
        loading.load_model(tmp_path)


def test_bad_dtype_and_missing_cuda_are_refused_first(no_weights, monkeypatch):
    with pytest.raises(ConfigError, match="unknown dtype 'bfloat61'.*bfloat16") as e:
        loading.load_model("embedded", dtype="bfloat61")
    assert isinstance(e.value, ValueError) and e.value.exit_code == 1
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(DeviceError, match="CUDA is not available") as e:
        loading.load_model("embedded", device="cuda")
    assert e.value.exit_code == 2
    with pytest.raises(ConfigError, match="unknown device 'gpu'"):
        loading.load_model("embedded", device="gpu")
