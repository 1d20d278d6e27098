"""The server's messages name the fault (issue 37): a bad Anthropic ``cache_control`` names
``cache_control`` and the field in it; ``messages.count_tokens`` through the official client counts
what ``messages.create`` runs; ``/metrics`` needs a key when keys are set, unless opened for a
scraper."""

from __future__ import annotations

import anthropic
import pytest

from promptcache.server import create_app
from serverkit import BLOCK, MODEL, http, running

SYSTEM = "You are a careful assistant for a travel agency in Lisbon. " * 4
MSGS = [{"role": "user", "content": "Plan a day in Rome."}]


def client(url: str, key: str = "none") -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=url, api_key=key, max_retries=0, timeout=60)


@pytest.fixture
def ant(server):
    return client(server[0])


@pytest.mark.parametrize("control, field, says", [
    ({"type": "ephemeral", "ttl": "2h"}, "cache_control.ttl", "'5m' or '1h'"),
    ({"type": "persistent"}, "cache_control.type", "'ephemeral'"),
])
def test_bad_cache_control_in_system_names_the_field(ant, control, field, says):
    system = [{"type": "text", "text": SYSTEM, "cache_control": control}]
    with pytest.raises(anthropic.BadRequestError) as e:
        ant.messages.create(model=MODEL, max_tokens=2, system=system, messages=MSGS)
    message = e.value.body["error"]["message"]
    assert message.startswith(f"system.0.{field}: ") and says in message, message


def test_bad_cache_control_in_a_message_block_and_at_the_top_name_the_field(ant):
    blocks = [{"type": "text", "text": "Hi.", "cache_control": {"type": "ephemeral", "ttl": "2h"}}]
    with pytest.raises(anthropic.BadRequestError) as e:
        ant.messages.create(model=MODEL, max_tokens=2, messages=[{"role": "user", "content": blocks}])
    assert e.value.body["error"]["message"].startswith("messages[0].content[0].cache_control.ttl: ")
    with pytest.raises(anthropic.BadRequestError) as e:
        ant.messages.create(model=MODEL, max_tokens=2, messages=MSGS,
                            extra_body={"cache_control": {"type": "persistent"}})
    assert e.value.body["error"]["message"].startswith("cache_control.type: ")


def test_count_tokens_counts_what_create_runs(ant):
    system = [{"type": "text", "text": SYSTEM, "cache_control": {"type": "ephemeral"}}]
    counted = ant.messages.count_tokens(model=MODEL, system=system, messages=MSGS)
    u = ant.messages.create(model=MODEL, max_tokens=2, system=system, messages=MSGS).usage
    assert counted.input_tokens == u.input_tokens + u.cache_creation_input_tokens + u.cache_read_input_tokens
    longer = ant.messages.count_tokens(model=MODEL, system=system, messages=[
        {"role": "user", "content": "Plan a day in Rome, then one in Florence."}])
    assert longer.input_tokens > counted.input_tokens


def test_count_tokens_errors_are_anthropic_shaped(ant):
    with pytest.raises(anthropic.NotFoundError) as e:
        ant.messages.count_tokens(model="other", messages=MSGS)
    assert e.value.body["type"] == "error" and "model 'other'" in e.value.body["error"]["message"]
    with pytest.raises(anthropic.BadRequestError) as e:
        ant.messages.count_tokens(model=MODEL, messages=MSGS, extra_body={"max_tokens": 5})
    assert e.value.body["error"]["message"] == "max_tokens: is not supported by this server"


def test_metrics_need_a_key_when_keys_are_set_unless_opened(pc):
    with running(create_app(pc, api_keys={"k1": "a"}, model_name=MODEL, block_size=BLOCK)) as url:
        status, _, body = http("GET", url + "/metrics")
        assert status == 401 and "API key" in body
        assert http("GET", url + "/metrics", key="wrong")[0] == 401
        status, _, body = http("GET", url + "/metrics", key="k1")
        assert status == 200 and "promptcache_requests_total" in body
        with pytest.raises(anthropic.AuthenticationError):
            client(url).messages.count_tokens(model=MODEL, messages=MSGS)
        assert client(url, "k1").messages.count_tokens(model=MODEL, messages=MSGS).input_tokens > 0
    with running(create_app(pc, api_keys={"k1": "a"}, model_name=MODEL, block_size=BLOCK, open_metrics=True)) as url:
        assert http("GET", url + "/metrics")[0] == 200
        assert http("GET", url + "/v1/models")[0] == 401  # only /metrics is opened


# -- vLLM's flags and --open-metrics on the command ----------------------------------------------
def serve_app(monkeypatch, *args):
    """(result, apps) of ``serve ARGS`` with uvicorn.run capturing the app instead of serving it."""
    import uvicorn
    from click.testing import CliRunner

    from promptcache.server.cli import serve

    apps = []
    monkeypatch.setattr(uvicorn, "run", lambda app, **kw: apps.append(app))
    return CliRunner().invoke(serve, ["--model", "embedded", *args]), apps


def test_tensor_parallel_is_refused_naming_replicas_and_the_vllm_connector(monkeypatch):
    out, apps = serve_app(monkeypatch, "--tensor-parallel-size", "2")
    assert out.exit_code == 2 and not apps and "Loading model" not in out.output
    assert "--tensor-parallel-size 2" in out.output and "sglang-router" in out.output
    assert "vLLM connector" in out.output


def test_gpu_memory_utilization_on_a_cpu_names_kv_pool_tokens(monkeypatch):
    out, apps = serve_app(monkeypatch, "--device", "cpu", "--gpu-memory-utilization", "0.9")
    assert out.exit_code == 2 and not apps
    assert "runs on cpu" in out.output and "--kv-pool-tokens" in out.output


def test_enable_prefix_caching_and_one_way_tensor_parallel_are_accepted(monkeypatch):
    out, apps = serve_app(monkeypatch, "--enable-prefix-caching", "--tensor-parallel-size", "1")
    assert out.exit_code == 0, out.output
    assert apps[0].state.prefix is not None  # the automatic prefix cache, always there


def test_pool_sized_from_device_memory():
    import click

    from promptcache.server.vllm_flags import pool_tokens

    gib = 2**30
    # 0.5 of 80 GiB = 40 GiB; 10 GiB in use, 4 GiB kept for stored states: 26 GiB at 1 MiB a token
    assert pool_tokens(0.5, 80 * gib, 70 * gib, 4 * gib, 2**20, 16) == 26 * 1024
    assert pool_tokens(0.5, 80 * gib, 70 * gib, 4 * gib, 3 * 2**20, 16) == 26 * 1024 // 3 // 16 * 16  # whole blocks
    with pytest.raises(click.UsageError, match=r"allows 8\.0 GiB .* 10\.0 GiB are in use"):
        pool_tokens(0.1, 80 * gib, 70 * gib, 0, 2**20, 16)


def test_open_metrics_flag_reaches_the_app(monkeypatch):
    out, apps = serve_app(monkeypatch, "--api-key", "k1")
    assert out.exit_code == 0, out.output
    out, apps_open = serve_app(monkeypatch, "--api-key", "k1", "--open-metrics")
    assert out.exit_code == 0, out.output
    with running(apps[0]) as url:
        assert http("GET", url + "/metrics")[0] == 401
    with running(apps_open[0]) as url:
        assert http("GET", url + "/metrics")[0] == 200


@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_memory_utilization_sizes_the_pool_on_a_gpu(monkeypatch):
    import torch

    out, apps = serve_app(monkeypatch, "--device", "cuda", "--gpu-memory-utilization", "0.3",
                          "--device-budget", "1GiB")
    assert out.exit_code == 0, out.output
    pool = apps[0].state.backend.pool
    total = torch.cuda.mem_get_info()[1]
    assert "KV pool:" in out.output and pool.buf.device.type == "cuda"
    assert 0 < pool.buf.numel() * pool.buf.element_size() <= 0.3 * total - 2**30
