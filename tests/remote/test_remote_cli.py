"""``--remote URL`` on the command line: ``compile`` publishes, ``run`` answers from Redis."""

from __future__ import annotations

import json
from pathlib import Path

from click.testing import CliRunner

from promptcache.cli import main
from promptcache.store.remote import PREFIX

ROOT = Path(__file__).resolve().parents[2]
SCHEMA, PROMPT = str(ROOT / "schemas" / "travel.xml"), str(ROOT / "examples" / "travel_tokyo.xml")


def test_compile_publishes_and_run_fetches(redis_server, tmp_path):
    runner = CliRunner()
    out = runner.invoke(main, ["compile", SCHEMA, "--out", str(tmp_path / "t"), "--device", "cpu",
                               "--remote", redis_server.url])
    assert out.exit_code == 0, out.output
    published = redis_server.client().keys(f"{PREFIX}:*:h")
    assert published
    out = runner.invoke(main, ["run", PROMPT, "--schema", SCHEMA, "--device", "cpu", "--max-new-tokens", "2",
                               "--json", "--remote", redis_server.url])
    assert out.exit_code == 0, out.output
    res = json.loads(out.output.strip().splitlines()[-1])
    assert set(res["hit_tiers"]) == {"remote"} and sum(res["hit_tiers"].values()) <= len(published)
    bad = runner.invoke(main, ["run", PROMPT, "--schema", SCHEMA, "--remote", "http://nowhere"])
    assert bad.exit_code == 1 and "--remote" in bad.output  # a bad value is bad input (exit 1), named
