"""The command line, through click's runner: every command, bad input, exit codes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from promptcache.cli import main

ROOT = Path(__file__).resolve().parents[2]
SCHEMA = str(ROOT / "schemas" / "travel.xml")
PROMPT = str(ROOT / "examples" / "travel_tokyo.xml")


@pytest.fixture
def runner():
    return CliRunner()


def invoke(runner, *args):
    return runner.invoke(main, [str(a) for a in args], catch_exceptions=False)


def test_help_lists_every_command(runner):
    out = invoke(runner, "--help").output
    for cmd in ("demo", "run", "compile", "inspect", "validate", "bench"):
        assert cmd in out
    for cmd in ("demo", "run", "compile", "inspect", "validate", "bench"):
        res = invoke(runner, cmd, "--help")
        assert res.exit_code == 0 and "Usage:" in res.output


def test_run_streams_then_prints_statistics(runner):
    res = invoke(runner, "run", PROMPT, "--schema", SCHEMA, "--max-new-tokens", "4")
    assert res.exit_code == 0, res.output
    last = res.stdout.strip().splitlines()[-1]
    assert last.startswith("[TTFT ") and "cached" in last and "tier hits: host" in last
    assert "| recomputed " in last and "| approximate |" in last  # a union member: drifted


def test_run_json_and_baseline(runner):
    res = invoke(runner, "run", PROMPT, "--schema", SCHEMA, "--max-new-tokens", "3", "--json")
    data = json.loads(res.stdout.strip().splitlines()[-1])
    assert data["cached_tokens"] > 100 and data["new_tokens"] > 0 and len(data["token_ids"]) <= 3
    assert data["finish_reason"] == ("length" if len(data["token_ids"]) == 3 else "stop")
    # the example imports a union member: drifted, so the default ("auto") recomputes some cached
    # tokens, which the usage does not count as served from stored states
    assert not data["exact"] and 0 < data["recomputed_tokens"] < data["cached_tokens"]
    assert data["usage"] == {"prompt_tokens": data["cached_tokens"] + data["new_tokens"],
                             "completion_tokens": len(data["token_ids"]),
                             "cached_tokens": data["cached_tokens"] - data["recomputed_tokens"],
                             "total_tokens": data["cached_tokens"] + data["new_tokens"] + len(data["token_ids"])}
    base = json.loads(invoke(runner, "run", PROMPT, "-s", SCHEMA, "--max-new-tokens", "3", "--json",
                             "--no-cache").stdout.strip().splitlines()[-1])
    assert base["cached_tokens"] == 0 and base["new_tokens"] == data["cached_tokens"] + data["new_tokens"]


def test_bad_sampling_setting_is_a_usage_error_before_loading(runner):
    res = runner.invoke(main, ["run", PROMPT, "--schema", SCHEMA, "--temperature", "-1"])
    assert res.exit_code == 2 and "SamplingParams.temperature must be a finite number >= 0, got -1" in res.output
    assert "Loading model" not in res.output


def test_compile_then_run_compiled(runner, tmp_path):
    res = invoke(runner, "compile", SCHEMA, "--out", tmp_path / "travel")
    assert res.exit_code == 0 and (tmp_path / "travel" / "manifest.json").is_file()
    assert "Compiled 'travel'" in res.output
    res = invoke(runner, "run", PROMPT, "--compiled", tmp_path / "travel", "--max-new-tokens", "2", "--json")
    data = json.loads(res.stdout.strip().splitlines()[-1])
    assert data["hit_tiers"] == {"disk": data["hit_tiers"]["disk"]}  # first use reads the artifact


def test_compiled_for_another_model_is_refused(runner, tmp_path):
    invoke(runner, "compile", SCHEMA, "--out", tmp_path / "t")
    manifest = tmp_path / "t" / "manifest.json"
    data = json.loads(manifest.read_text())
    data["model"]["weights_sha256"] = "0" * 64
    manifest.write_text(json.dumps(data))
    res = invoke(runner, "run", PROMPT, "--compiled", tmp_path / "t", "--max-new-tokens", "1")
    assert res.exit_code == 1 and "model weights differ" in res.output and "--model embedded" in res.output
    before = manifest.read_bytes()
    res = invoke(runner, "run", PROMPT, "--compiled", tmp_path / "t", "--recompile", "--max-new-tokens", "1")
    assert res.exit_code == 1 and "not recompiled in place" in res.output and manifest.read_bytes() == before


def test_recompile_never_overwrites_another_models_artifact(runner, tmp_path):
    """Following the tool's advice must not destroy work: an artifact compiled for another model
    (here: embedded in bfloat16, run with --dtype float32) is refused by --recompile, untouched,
    with the --model to pass; without --model/--dtype, run takes the ones it records."""
    res = invoke(runner, "compile", SCHEMA, "--dtype", "bfloat16", "--out", tmp_path / "b")
    assert res.exit_code == 0, res.output
    before = {f.name: f.read_bytes() for f in (tmp_path / "b").iterdir()}
    for extra in ([], ["--recompile"], ["--recompile", "--schema", SCHEMA]):
        res = invoke(runner, "run", PROMPT, "--compiled", tmp_path / "b", "--dtype", "float32", *extra,
                     "--max-new-tokens", "1")
        assert res.exit_code == 1 and "--model embedded --dtype bfloat16" in res.output, res.output
        assert "--recompile" not in res.output.splitlines()[-1]  # no advice that would overwrite it
        assert {f.name: f.read_bytes() for f in (tmp_path / "b").iterdir()} == before
    for extra in ([], ["--dtype", "bfloat16"]):
        res = invoke(runner, "run", PROMPT, "--compiled", tmp_path / "b", *extra, "--max-new-tokens", "1")
        assert res.exit_code == 0, res.output


def test_bad_schema_gives_file_line_message(runner, tmp_path):
    bad = tmp_path / "bad.xml"
    bad.write_text('<schema name="b">\n  <module name="a">unclosed\n</schema>\n')
    res = invoke(runner, "compile", bad, "--out", tmp_path / "o")
    assert res.exit_code == 1 and f"{bad}:" in res.output and "malformed XML" in res.output
    assert not (tmp_path / "o" / "manifest.json").exists()


def test_unknown_schema_in_run(runner, tmp_path):
    p = tmp_path / "p.xml"
    p.write_text('<prompt schema="nope"><a/></prompt>')
    res = invoke(runner, "run", p, "--schema", SCHEMA)
    assert res.exit_code == 1 and "unknown schema 'nope'" in res.output


def test_inspect_shows_spans_unions_and_parameters(runner):
    res = invoke(runner, "inspect", SCHEMA, PROMPT)
    assert res.exit_code == 0
    out = res.output
    assert "schema 'travel'" in out and "positions" in out
    assert "union u0" in out and "parameter trip.days" in out
    assert "prompt:" in out and "cached" in out and "new" in out


def test_validate_reports_file_line_and_exit_code(runner, tmp_path):
    ok = invoke(runner, "validate", SCHEMA, PROMPT)
    assert ok.exit_code == 0 and "ok (prompt)" in ok.output
    bad_prompt = tmp_path / "bad_prompt.xml"
    bad_prompt.write_text('<prompt schema="travel">\n  <tokyo/>\n  <paris/>\n</prompt>\n')
    res = invoke(runner, "validate", SCHEMA, bad_prompt)
    assert res.exit_code == 1
    assert f"{bad_prompt}:3: two members of one union imported" in res.output
    broken = tmp_path / "broken.xml"
    broken.write_text("<schema name='x'><module name='m'>")
    res = invoke(runner, "validate", broken)
    assert res.exit_code == 1 and f"{broken}:1: malformed XML" in res.output


def test_offline_model_failure_says_so(runner, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", True)  # read at import: set it too
    res = invoke(runner, "run", PROMPT, "--schema", SCHEMA, "--model", "no-such-org/no-such-model")
    assert res.exit_code == 2 and "local directory" in res.output


def test_demo_runs_offline(runner):
    res = invoke(runner, "demo", "--max-new-tokens", "2")
    assert res.exit_code == 0, res.output
    assert res.output.count("TTFT with cache") == 2 and "speed-up" in res.output
    assert "outputs identical:  yes (state equals a plain prefill: yes)" in res.output


def test_bench_prints_ratios(runner):
    res = invoke(runner, "bench", "--model", "embedded", "--schema-tokens", "256", "--new-tokens", "8",
                 "--repeats", "1")
    assert res.exit_code == 0, res.output
    assert "faster" in res.output and "the limit" in res.output and "stored bytes per token" in res.output


def test_demo_schema_is_the_shipped_one():
    shipped = (ROOT / "schemas" / "long_doc_qa.xml").read_text()
    assert (ROOT / "promptcache" / "assets" / "demo" / "long_doc_qa.xml").read_text() == shipped


def test_one_count_of_tokens_and_positions_everywhere(runner, tmp_path, caplog):
    """compile, its progress line, inspect and validate count a schema the same way, and
    validate / inspect refuse what compile refuses (a schema past the model's context)."""
    import logging
    import re

    with caplog.at_level(logging.INFO, logger="promptcache.progress"):
        out = invoke(runner, "compile", SCHEMA, "--out", tmp_path / "c").output
    counts = set(re.findall(r"(\d+) tokens stored, positions \[0, (\d+)\)", out))
    for cmd in (["inspect", SCHEMA], ["validate", SCHEMA]):
        counts |= set(re.findall(r"(\d+) tokens stored, positions \[0, (\d+)\)", invoke(runner, *cmd).output))
    assert len(counts) == 1, counts
    stored = next(iter(counts))[0]
    progress = [m for r in caplog.records for m in re.findall(r"(\d+)/(\d+) tokens", r.getMessage())]
    assert progress and progress[-1] == (stored, stored)
    big = tmp_path / "big.xml"
    big.write_text(Path(SCHEMA).read_text().replace('length="4"', 'length="1000000"', 1))
    for cmd in (["compile", big, "--out", tmp_path / "b"], ["validate", big], ["inspect", big]):
        res = invoke(runner, *cmd)
        assert res.exit_code == 1 and "more than the model's limit of 16384" in res.output, (cmd, res.output)
