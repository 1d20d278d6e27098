"""``python -m promptcache.server``: loads with progress, says it is ready, serves keys, stops on Ctrl-C."""

from __future__ import annotations

import signal
import time

import pytest

from serverkit import ROOT, client, free_port, start_until

from promptcache.server.cli import read_key_file


def test_key_file_format(tmp_path):
    f = tmp_path / "keys"
    f.write_text("# tenants\nk1 alpha\n\nk2   beta\nk3 alpha\n")
    assert read_key_file(f) == {"k1": "alpha", "k2": "beta", "k3": "alpha"}
    f.write_text("k1 alpha\nk2\n")
    with pytest.raises(ValueError, match=r"keys:2: expected 'KEY NAMESPACE'"):
        read_key_file(f)
    f.write_text("k1 a\nk1 b\n")
    with pytest.raises(ValueError, match="twice"):
        read_key_file(f)


@pytest.mark.slow  # a subprocess loads torch and the model (~25 s on a busy 2-core machine)
def test_serve_command_starts_serves_and_stops_on_ctrl_c(tmp_path):
    keys = tmp_path / "keys.txt"
    keys.write_text("secret-1 tenant-a\n")
    port = free_port()
    args = ["-m", "promptcache.server", "embedded", "--schema", str(ROOT / "schemas" / "travel.xml"),
            "--api-key-file", str(keys), "--api-key", "secret-2", "--served-model-name", "tiny", "--port", str(port)]
    proc, log = start_until(args, "Ready", cwd=tmp_path)
    try:
        text = "".join(log)
        assert "Loading model embedded" in text and "travel.xml: " in text and "tokens (100%)" in text
        assert "2 API keys in 2 namespaces" in text
        oai = client(f"http://127.0.0.1:{port}", "secret-1")
        pml = '<prompt schema="travel"><tokyo/><user>Food?</user></prompt>'
        for _ in range(50):  # uvicorn binds right after the message
            try:
                r = oai.chat.completions.create(model="tiny", messages=[], max_tokens=2, extra_body={"pml": pml})
                break
            except Exception:  # noqa: BLE001 - not listening yet
                time.sleep(0.1)
        assert r.usage.prompt_tokens_details.cached_tokens > 0  # the schema was encoded in tenant-a's namespace
        r2 = client(f"http://127.0.0.1:{port}", "secret-2").chat.completions.create(  # --api-key: the default namespace
            model="tiny", messages=[], max_tokens=2, extra_body={"pml": pml})
        assert r2.usage.prompt_tokens_details.cached_tokens > 0
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=30)
        assert proc.returncode == 0, err
        assert "Stopped." in err
        assert "promptcache.access: POST /v1/chat/completions 200 prompt=" in err  # one line per request
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_no_key_file_binds_loopback_and_says_so(monkeypatch):
    import uvicorn
    from click.testing import CliRunner

    from promptcache.server.cli import serve

    calls = []
    monkeypatch.setattr(uvicorn, "run", lambda app, **kw: calls.append(kw))
    out = CliRunner().invoke(serve, ["--model", "embedded", "--port", "9"])
    assert out.exit_code == 0, out.output
    assert calls == [{"host": "127.0.0.1", "port": 9, "log_level": "warning", "timeout_graceful_shutdown": 10.0}]
    assert "No --api-key / --api-key-file" in out.output and "127.0.0.1 (this machine only)" in out.output


def test_model_as_argument_and_flags_that_disagree(monkeypatch):
    import uvicorn
    from click.testing import CliRunner

    from promptcache.server.cli import serve

    monkeypatch.setattr(uvicorn, "run", lambda app, **kw: None)
    out = CliRunner().invoke(serve, ["embedded", "--model", "smollm2"])
    assert out.exit_code == 2 and "MODEL is 'embedded' but --model is 'smollm2'" in out.output
    out = CliRunner().invoke(serve, ["embedded", "--max-model-len", "100000000"])
    assert out.exit_code == 2 and "--max-model-len" in out.output
    out = CliRunner().invoke(serve, ["embedded", "--api-key", "a", "--api-key", "a"])
    assert out.exit_code == 2 and "given twice" in out.output


def test_bad_key_file_stops_before_loading(tmp_path):
    from click.testing import CliRunner

    from promptcache.server.cli import serve

    bad = tmp_path / "keys"
    bad.write_text("only-a-key\n")
    out = CliRunner().invoke(serve, ["--api-key-file", str(bad)])
    assert out.exit_code != 0 and "keys:1: expected 'KEY NAMESPACE'" in out.output
    assert "Loading model" not in out.output


def test_limit_and_browser_options_reach_the_app(monkeypatch):
    """The command's --allowed-hosts, --cors-origin and --max-* options configure what it serves."""
    import json
    import urllib.request

    import uvicorn
    from click.testing import CliRunner
    from serverkit import http, running

    from promptcache.server.cli import serve

    assert CliRunner().invoke(serve, ["--max-chars", "0"]).exit_code == 2  # refused before loading
    apps = []
    monkeypatch.setattr(uvicorn, "run", lambda app, **kw: apps.append(app))
    out = CliRunner().invoke(serve, ["--model", "embedded", "--allowed-hosts", "api.example, 127.0.0.1",
                                     "--cors-origin", "https://app.example", "--max-chars", "40"])
    assert out.exit_code == 0, out.output
    with running(apps[0]) as url:
        status, _, text = http("POST", url + "/v1/chat/completions",
                               {"model": "embedded", "messages": [{"role": "user", "content": "x" * 41}]})
        assert status == 400 and "--max-chars" in json.loads(text)["error"]["message"]
        req = urllib.request.Request(url + "/health", headers={"host": "api.example", "origin": "https://app.example"})
        with urllib.request.urlopen(req, timeout=30) as r:
            assert r.headers["access-control-allow-origin"] == "https://app.example"
        req = urllib.request.Request(url + "/health", headers={"host": "localhost"})  # not on the given list
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(req, timeout=30)
        assert e.value.code == 400


def test_host_allow_list_defaults():
    from promptcache.server.cli import host_list
    from promptcache.server.core.limits import LOOPBACK_HOSTS

    assert host_list("127.0.0.1", ()) == LOOPBACK_HOSTS and host_list("0.0.0.0", ()) is None
    assert host_list("0.0.0.0", ("a.example,b.example", "c.example")) == ("a.example", "b.example", "c.example")
    assert host_list("127.0.0.1", ("*",)) is None


def test_serve_has_one_option_per_serving_config_field_with_its_default():
    import dataclasses

    from promptcache.engine.serving_core.prefix import DEFAULT_BLOCK_SIZE
    from promptcache.engine import ServingConfig
    from promptcache.server.cli import serve
    from promptcache.tunables import BLOCK_SIZE

    options = {p.name: p for p in serve.params}
    for fl in dataclasses.fields(ServingConfig):
        help_ = options[fl.name].help
        assert help_.startswith(fl.metadata["help"]) and f"default {fl.default};" in help_, help_
        assert options[fl.name].heading == "Serving core (ServerConfig.serving)"
    assert ServingConfig().block_size == DEFAULT_BLOCK_SIZE == BLOCK_SIZE == 16  # server and chat alike
    from click.testing import CliRunner

    result = CliRunner().invoke(serve, ["--block-size", "0"])
    assert result.exit_code == 2 and "--block-size" in result.output


def _capture_config(monkeypatch):
    """Run ``serve`` up to uvicorn; returns the list the engine configs it loaded go to."""
    import uvicorn

    import promptcache.frontend.common as common

    configs, load = [], common.load_engine
    monkeypatch.setattr(common, "load_engine", lambda *a: configs.append(a[3]) or load(*a))
    monkeypatch.setattr(uvicorn, "run", lambda app, **kw: configs.append(kw))
    return configs


def test_budgets_are_the_store_options(monkeypatch):
    from click.testing import CliRunner

    from promptcache.server.cli import serve

    configs = _capture_config(monkeypatch)
    out = CliRunner().invoke(serve, ["embedded", "--host-budget", "1GiB", "--pin-budget", "256MiB"])  # serve's default: 4GiB each
    assert out.exit_code == 0 and configs[0].store.host_budget == 2**30 and configs[0].store.device_budget == 4 * 2**30
    assert configs[0].store.pin_budget == 2**28
    for flag in ("--cache-gb", "--pin-gb"):  # the GiB spellings are gone: a usage error naming the option
        out = CliRunner().invoke(serve, ["embedded", flag, "1"])
        assert out.exit_code == 2 and "No such option" in out.output and flag in out.output, out.output
        assert "Loading model" not in out.output


def test_server_settings_come_from_the_environment_and_the_config_file(monkeypatch, tmp_path):
    from click.testing import CliRunner

    from promptcache.server.cli import serve

    configs = _capture_config(monkeypatch)
    toml = tmp_path / "serve.toml"
    toml.write_text('[store]\nhost_budget = "64MiB"\n[server]\nport = 9100\ndrain_timeout = 2.5\n'
                    '[server.serving]\nmax_num_seqs = 8\n')
    out = CliRunner().invoke(serve, ["embedded", "--config", str(toml)], env={"PROMPTCACHE_PORT": "9200"})
    assert out.exit_code == 0, out.output
    assert configs[0].store.host_budget == 64 * 2**20
    assert configs[1]["port"] == 9200 and configs[1]["timeout_graceful_shutdown"] == 2.5  # environment over file
    toml.write_text("[server]\nprot = 1\n")
    out = CliRunner().invoke(serve, ["embedded", "--config", str(toml)])
    assert out.exit_code == 2 and "unknown keys prot" in out.output


def test_serve_and_run_help_list_every_flag_under_its_section():
    from click.testing import CliRunner

    from promptcache.cli import main

    serve_help = CliRunner().invoke(main, ["serve", "--help"]).output
    run_help = CliRunner().invoke(main, ["run", "--help"]).output
    for heading in ("Server (ServerConfig):", "Serving core (ServerConfig.serving):",
                    "Request limits (ServerConfig.limits):", "Runner (EngineConfig.runner):",
                    "Store (EngineConfig.store):", "Recompute (EngineConfig.recompute):"):
        assert heading in serve_help
    for flag in ("--host ", "--port ", "--max-queue", "--drain-timeout", "--max-model-len", "--allowed-hosts",
                 "--cors-origin", "--kv-pool-tokens", "--max-chars", "--host-budget", "--device-budget",
                 "--pin-budget", "--recompute ", "--packed-linear", "--api-key-file", "--schema"):
        assert flag in serve_help, flag
    assert "Store (EngineConfig.store):" in run_help and "--host-budget" in run_help and "--port" not in run_help
    assert serve_help.index("--schema") < serve_help.index("Server (ServerConfig):") < serve_help.index("--host-budget")


def test_the_default_config_raises_no_deprecation_warning(monkeypatch):
    """Building an engine and serving a request with the defaults uses no deprecated name."""
    import warnings

    import uvicorn
    from click.testing import CliRunner
    from serverkit import http, running

    from promptcache.server.cli import serve

    apps = []
    monkeypatch.setattr(uvicorn, "run", lambda app, **kw: apps.append(app))
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        out = CliRunner().invoke(serve, ["embedded"], catch_exceptions=False)
        assert out.exit_code == 0, out.output
        with running(apps[0]) as url:
            status, _, text = http("POST", url + "/v1/chat/completions",
                                   {"model": "embedded", "messages": [{"role": "user", "content": "Hi"}],
                                    "max_tokens": 2})
        assert status == 200, text


def test_serve_packs_linears_by_default_on_a_cpu_in_float32_and_a_user_setting_wins(monkeypatch):
    from promptcache.frontend.options import engine_config
    from promptcache.models.native_dtype import bf16_native
    from promptcache.server.cli import serve_defaults

    assert serve_defaults("cpu", "auto")["packed_linear"] is True
    assert serve_defaults("cpu", "float16")["packed_linear"] is False  # packed linears are float32 or bfloat16
    assert serve_defaults("cpu", "bfloat16")["packed_linear"] is bf16_native("cpu")
    monkeypatch.setenv("PROMPTCACHE_BF16", "0")  # a CPU without bfloat16 instructions: no bfloat16 packing
    assert serve_defaults("cpu", "bfloat16")["packed_linear"] is False
    assert serve_defaults("cpu", "auto")["packed_linear"] is True  # auto is float32 there
    assert engine_config({}, None, env={}, defaults=serve_defaults("cpu", "float32")).runner.packed_linear
    off = engine_config({"packed_linear": False}, None, env={}, defaults=serve_defaults("cpu", "float32"))
    assert off.runner.packed_linear is False
    # decode steps captured as CUDA graphs: serve's default on a GPU only, a user's setting wins
    assert serve_defaults("cpu", "float32")["cuda_graphs"] is False
    monkeypatch.setattr("torch.cuda.is_available", lambda: True)  # check_device's question only
    assert serve_defaults("cuda", "float32")["cuda_graphs"] is True
    assert serve_defaults("cuda", "float32")["packed_linear"] is False
    assert engine_config({"cuda_graphs": False}, None, env={},
                         defaults=serve_defaults("cuda", "float32")).runner.cuda_graphs is False
    env = engine_config({}, None, env={"PROMPTCACHE_PACKED_LINEAR": "0"}, defaults=serve_defaults("cpu", "float32"))
    assert env.runner.packed_linear is False


def test_documents_system_encodes_the_served_documents_after_the_prompts_prefix(monkeypatch, tmp_path):
    import uvicorn
    from click.testing import CliRunner

    from promptcache import PromptCache
    from promptcache.models.embedded import embedded_model
    from promptcache.rag import DocumentStoreError
    from promptcache.server.cli import load_documents, serve

    texts = tmp_path / "texts"
    texts.mkdir()
    (texts / "kyoto.txt").write_text("Kyoto has thousands of shrines.", encoding="utf-8")
    pc = PromptCache(*embedded_model("embedded"))
    store = load_documents(pc, texts, "default", "Answer briefly.")
    assert store.system == "Answer briefly." and store.encode_prefix == store.layout("Q?", [], "Answer briefly.").spans[0].token_ids
    assert store.prefill("Where?", ["kyoto"], recompute=0).exact  # no system message: the store's; first document exact
    folder = tmp_path / "store"
    from promptcache.rag import DocumentStore

    DocumentStore(pc, folder).add("kyoto", "Kyoto has thousands of shrines.")  # encoded without a system text
    assert load_documents(pc, folder, "default").system is None  # the folder's encoding kept
    with pytest.raises(DocumentStoreError, match="reencode=True"):
        load_documents(pc, folder, "default", "Answer briefly.")
    monkeypatch.setattr(uvicorn, "run", lambda app, **kw: None)
    out = CliRunner().invoke(serve, ["embedded", "--documents-system", "Answer briefly."])
    assert out.exit_code == 2 and "--documents-system needs --documents" in out.output
    out = CliRunner().invoke(serve, ["embedded", "--documents", str(folder), "--documents-system", "Answer briefly."])
    assert out.exit_code == 1 and "reencode=True" in out.output
    out = CliRunner().invoke(serve, ["embedded", "--documents", str(texts), "--documents-system", "Answer briefly."])
    assert out.exit_code == 0, out.output
