"""The first hour of a new user at the command line (issue 16): prompt input, one-line errors
with exit codes, the EngineConfig options and their precedence, stale artifacts, validate's
tokenizer and unknown schemas, progress on a terminal and none when piped, chat, reprs."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
from click.testing import CliRunner
from ptyrun import cli, run_on_pty

from promptcache.cli import main
from promptcache.frontend.options import FIELDS, engine_config, option_name, parse_size
from promptcache.engine import EngineConfig
from promptcache.settings import leaves

ROOT = Path(__file__).resolve().parents[2]
SCHEMA = ROOT / "schemas" / "travel.xml"
PROMPT = ROOT / "examples" / "travel_tokyo.xml"
ENV = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}


def invoke(*args, input=None, env=None):
    return CliRunner().invoke(main, [str(a) for a in args], input=input, env=env, catch_exceptions=False)


def one_error_line(output: str) -> str:
    """The single 'error: ...' line of an output; asserts there is exactly one and no traceback."""
    assert "Traceback" not in output
    lines = [ln for ln in output.splitlines() if ln.startswith("error:")]
    assert len(lines) == 1, output
    return lines[0]


# -- prompt input: a file is a Path, -p TEXT and stdin are text --------------------------------
def test_prompt_as_text_and_stdin_give_the_file_answer():
    base = json.loads(invoke("run", PROMPT, "-s", SCHEMA, "--max-new-tokens", "3", "--json").stdout.splitlines()[-1])
    text = PROMPT.read_text()
    by_text = json.loads(invoke("run", "-p", text, "-s", SCHEMA, "--max-new-tokens", "3", "--json")
                         .stdout.splitlines()[-1])
    by_stdin = json.loads(invoke("run", "-", "-s", SCHEMA, "--max-new-tokens", "3", "--json", input=text)
                          .stdout.splitlines()[-1])
    assert base["token_ids"] == by_text["token_ids"] == by_stdin["token_ids"]
    assert base["cached_tokens"] == by_text["cached_tokens"] > 100


def test_files_reach_the_library_as_paths_and_text_as_str(monkeypatch):
    """The library's rule (issue 12): a str is PML or text, never a file name; a Path is a file."""
    from promptcache.engine import PromptCache

    seen = []
    real = PromptCache.generate

    def spy(self, prompt, *a, **k):
        seen.append(prompt)
        return real(self, prompt, *a, **k)

    monkeypatch.setattr(PromptCache, "generate", spy)
    for args in ([PROMPT], ["-p", str(PROMPT), "--raw"], ["-", "--raw"], ["-"]):
        res = invoke("run", *args, "-s", SCHEMA, "--max-new-tokens", "1", "--json", input="plain words")
        assert res.exit_code in (0, 1), res.output
    assert seen[0] == PROMPT and isinstance(seen[0], Path)
    assert seen[1] == str(PROMPT) and type(seen[1]) is str  # text that happens to name a file: still text
    assert seen[2] == "plain words"
    assert seen[3] == "<prompt><user>plain words</user></prompt>"  # without --raw: a user turn of the template


def test_no_prompt_or_two_prompts_is_a_usage_error():
    for args in (["run"], ["run", PROMPT, "-p", "hi"]):
        res = CliRunner().invoke(main, [str(a) for a in args])
        assert res.exit_code == 2 and "exactly one" in res.output and "Loading model" not in res.output


# -- errors: one line, the fix, an exit code ---------------------------------------------------
def test_cuda_without_cuda_is_refused_before_loading(monkeypatch):
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    res = invoke("run", PROMPT, "-s", SCHEMA, "--device", "cuda")
    assert res.exit_code == 2 and "Loading model" not in res.output  # no weights loaded
    line = one_error_line(res.output)
    assert line.startswith("error: --device cuda: CUDA is not available here") and line.endswith("use --device cpu")


def test_dtype_typo_is_a_choice_error():
    res = CliRunner().invoke(main, ["run", str(PROMPT), "--dtype", "bfloat61"])
    assert res.exit_code == 2 and "Invalid value for '--dtype'" in res.output and "'bfloat16'" in res.output
    assert "Loading model" not in res.output


def test_validate_offline_names_the_local_alternative(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", True)
    res = invoke("validate", SCHEMA, "--model", "no-such-org/no-such-model")
    assert res.exit_code == 2
    line = one_error_line(res.output)
    assert "no-such-org/no-such-model" in line and "local directory" in line


def test_unknown_model_is_one_line(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", True)
    res = invoke("run", "-p", "hi", "--model", tmp_path / "no-model-here")
    assert res.exit_code in (1, 2)
    assert "no-model-here" in one_error_line(res.output)


def test_bad_pml_is_one_line_with_file_and_line(tmp_path):
    bad = tmp_path / "p.xml"
    bad.write_text('<prompt schema="travel">\n  <tokyo/> & more\n</prompt>\n')
    res = invoke("run", bad, "-s", SCHEMA, "--max-new-tokens", "1")
    assert res.exit_code == 1 and one_error_line(res.output).startswith(f"error: {bad}:2:")


# -- the EngineConfig options ------------------------------------------------------------------
def test_every_engine_config_field_has_an_option_everywhere():
    fields = {leaf.name for leaf in leaves(EngineConfig)} - {"device"}  # device: --device
    assert set(FIELDS) == fields and {"host_budget", "recompute", "recompute_selection", "packed_linear"} <= fields
    for cmd in ("run", "compile", "bench", "serve", "chat"):
        out = invoke(cmd, "--help").output
        for name in fields:
            assert option_name(name) in out, (cmd, name)
        assert "--config" in out and "--no-pin-memory" in out


def test_precedence_command_line_over_environment_over_file_over_defaults(tmp_path):
    cfg = tmp_path / "engine.toml"
    cfg.write_text('namespace = "from-file"\n[store]\nhost_budget = "1GiB"\nspill_dir = "/tmp/file"\n'
                   '[runner]\nencode_chunk = 7\n')
    env = {"PROMPTCACHE_NAMESPACE": "from-env", "PROMPTCACHE_HOST_BUDGET": "2GiB", "PROMPTCACHE_PIN_MEMORY": "0"}
    c = engine_config({"namespace": "from-cli"}, cfg, env=env)
    assert c.namespace == "from-cli"  # command line wins
    assert c.store.host_budget == 2 * 2**30 and c.store.pin_memory is False  # environment over the file
    assert c.store.spill_dir == "/tmp/file" and c.runner.encode_chunk == 7  # the file over the defaults
    assert c.store.device_budget is None and c.recompute.fraction == "auto"  # defaults
    assert engine_config({}, None, env={}) == EngineConfig()


def test_sizes():
    assert parse_size("4GiB") == 4 * 2**30 and parse_size("512MB") == 512 * 10**6 and parse_size("1e3") == 1000
    assert parse_size("none") is None
    with pytest.raises(ValueError, match="bad size '4 parsecs'"):
        parse_size("4 parsecs")


def test_bad_setting_names_its_source(tmp_path):
    res = invoke("run", "-p", "hi", env={"PROMPTCACHE_RECOMPUTE": "2"})
    assert res.exit_code == 1 and "Loading model" not in res.output
    assert one_error_line(res.output).startswith("error: environment PROMPTCACHE_RECOMPUTE: RecomputeConfig.fraction")
    ok = invoke("run", "-p", "hi", "--recompute", "0", "--max-new-tokens", "1", env={"PROMPTCACHE_RECOMPUTE": "2"})
    assert ok.exit_code == 0  # the command line wins over the bad environment value
    cfg = tmp_path / "c.toml"
    cfg.write_text("host_budjet = 5\n")
    res = invoke("run", "-p", "hi", "--config", cfg)
    assert res.exit_code == 1 and "unknown keys host_budjet" in one_error_line(res.output)
    res = invoke("run", "-p", "hi", "--host-budget", "lots")
    assert res.exit_code == 1 and one_error_line(res.output).startswith("error: --host-budget: bad size 'lots'")


# -- stale state -------------------------------------------------------------------------------
def test_compiled_artifact_of_an_edited_schema_is_refused_or_recompiled(tmp_path):
    schema = tmp_path / "travel.xml"
    shutil.copy(SCHEMA, schema)
    assert invoke("compile", schema, "--out", tmp_path / "c").exit_code == 0
    fresh = invoke("run", PROMPT, "--compiled", tmp_path / "c", "--schema", schema, "--max-new-tokens", "1")
    assert fresh.exit_code == 0 and "matches" in fresh.output
    schema.write_text(schema.read_text().replace("meticulous travel planner", "careful travel planner"))
    res = invoke("run", PROMPT, "--compiled", tmp_path / "c", "--schema", schema, "--max-new-tokens", "1")
    assert res.exit_code == 1
    line = one_error_line(res.output)
    assert "schema text differs" in line and "--recompile" in line
    res = invoke("run", PROMPT, "--compiled", tmp_path / "c", "--schema", schema, "--recompile",
                 "--max-new-tokens", "1")
    assert res.exit_code == 0 and f"Recompiled {tmp_path / 'c'}" in res.output and "schema text differs" in res.output
    again = invoke("run", PROMPT, "--compiled", tmp_path / "c", "--schema", schema, "--max-new-tokens", "1")
    assert again.exit_code == 0 and "matches" in again.output  # the recompiled artifact is the edited schema's


def test_validate_names_its_tokenizer_and_fails_an_unknown_schema(tmp_path):
    res = invoke("validate", SCHEMA, PROMPT)
    assert res.exit_code == 0 and res.output.splitlines()[0].startswith("tokenizer: embedded tokenizer")
    res = invoke("validate", PROMPT)  # its schema is not given
    assert res.exit_code == 1 and "unknown schema 'travel'" in res.output and "schemas given: none" in res.output
    res = invoke("inspect", SCHEMA)
    assert res.output.splitlines()[0] == "tokenizer: embedded tokenizer (pass --model for your model's)"


def test_src_root_widens_where_src_files_come_from(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.txt").write_text("Alpha text for the module.")
    (tmp_path / "s").mkdir()
    schema = tmp_path / "s" / "x.xml"
    schema.write_text('<schema name="x"><module name="a" src="../docs/a.txt"/></schema>')
    res = invoke("validate", schema)
    assert res.exit_code == 1 and "outside the allowed folder" in res.output
    res = invoke("validate", schema, "--src-root", tmp_path)
    assert res.exit_code == 0, res.output
    res = invoke("run", "-p", '<prompt schema="x"><a/> Go.</prompt>', "-s", schema, "--src-root", tmp_path,
                 "--max-new-tokens", "1", "--json")
    assert res.exit_code == 0 and json.loads(res.stdout.splitlines()[-1])["cached_tokens"] > 0


# -- help --------------------------------------------------------------------------------------
def test_help_names_no_repository_files_and_documents_json_fields():
    for cmd in ([], ["run"], ["compile"], ["inspect"], ["validate"], ["bench"], ["demo"], ["chat"]):
        out = invoke(*cmd, "--help").output
        assert not re.search(r"\b(schemas|examples)/\w", out), (cmd, out)
    out = invoke("run", "--help").output
    from promptcache.cli.commands import JSON_FIELDS

    for field in JSON_FIELDS:
        assert f"{field}:" in out


# -- progress: a bar on a terminal, log lines when piped ---------------------------------------
def test_progress_bar_on_a_terminal_and_none_when_piped(tmp_path):
    tty = run_on_pty(cli("compile", str(SCHEMA), "--out", str(tmp_path / "a")), env=ENV, timeout=300)
    assert "Compiled 'travel'" in tty
    assert re.search(r"encoding travel: +\d+%\|", tty) and "\r" in tty  # tqdm's bar, redrawn in place
    piped = subprocess.run(cli("compile", str(SCHEMA), "--out", str(tmp_path / "b")), env=ENV,
                           capture_output=True, text=True, timeout=300)
    assert piped.returncode == 0
    assert "%|" not in piped.stderr and "\r" not in piped.stderr
    assert re.search(r"^encoding travel: (\d+)/\1 tokens \(100%\)$", piped.stderr, re.M)


def test_bench_says_what_it_is_doing():
    res = invoke("bench", "--model", "embedded", "--schema-tokens", "128", "--new-tokens", "4", "--repeats", "1")
    assert res.exit_code == 0
    steps = [ln for ln in res.output.splitlines() if ln.startswith("bench: ")]
    assert steps[0].startswith("bench: encoding a 128-token schema") and steps[1].startswith("bench: warm-up")
    assert steps[2].startswith("bench: timing 1 rounds, round-robin") and steps[3].startswith("bench: round 1/1")


# -- chat through a terminal -------------------------------------------------------------------
def test_chat_answers_from_the_schema_from_turn_one_then_reuses_turns():
    out = run_on_pty(cli("chat", "--schema", str(SCHEMA), "--max-new-tokens", "3"),
                     lines=["Where should we eat?", "/help", "And on day two?", "Thanks, anything else?"],
                     wait_for="you> ", env=ENV, timeout=300)
    stats = re.findall(r"\[TTFT [\d.]+ ms \| cached (\d+) of (\d+) tokens \| new (\d+) tokens \| "
                       r"(exact|approximate \(recompute auto\))\]", out)
    assert len(stats) == 3, out  # /help went to the session, not to the model
    assert "/use NAME" in out and "importing food, accessibility" in out and "trip (days, travelers)" in out
    cached = [int(c) for c, *_ in stats]
    assert cached[0] > 0, out  # the schema's modules, on the first turn
    assert stats[0][3].startswith("approximate")  # modules spliced with drift (recompute auto): said so
    assert cached[2] > cached[1] > 0 and stats[2][3] == "exact"  # later turns: exact prefix blocks


def test_ctrl_c_exits_130():
    from promptcache.frontend.errors import guard

    @guard
    def interrupted():
        raise KeyboardInterrupt

    with pytest.raises(SystemExit) as e:
        interrupted()
    assert e.value.code == 130


# -- reprs -------------------------------------------------------------------------------------
def test_reprs_are_short():
    from promptcache import PromptCache

    pc = PromptCache.from_pretrained("embedded")
    entry = pc.add_schema(SCHEMA)
    gen = pc.generate(PROMPT, max_new_tokens=40)
    pre = pc.prefill(PROMPT)
    for obj, must in ((entry, "stored_tokens="), (gen, "tokens=40"), (pre, "cached_tokens=")):
        text = repr(obj)
        assert len(text) < 400 and must in text, text
    assert "2 unions" in repr(entry)


def test_recompute_setting_takes_auto_or_a_fraction():
    assert engine_config({}, env={}).recompute.fraction == "auto"  # the default
    assert engine_config({"recompute": "0.3"}, env={}).recompute.fraction == 0.3
    assert engine_config({}, env={"PROMPTCACHE_RECOMPUTE": "AUTO"}).recompute.fraction == "auto"
    with pytest.raises(ValueError, match="^--recompute: RecomputeConfig.fraction .--recompute. must be 'auto' or a "
                                         "fraction in"):
        engine_config({"recompute": "sometimes"}, env={})


def test_every_option_has_a_help_sentence():
    import click

    missing = [(name, p.opts[0]) for name, cmd in main.commands.items() for p in cmd.params
               if isinstance(p, click.Option) and not p.help]
    assert missing == []
