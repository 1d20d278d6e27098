"""The command line's messages name the fault and the fix (issue 37): validate reports every error
of a file in one run (capped), a compiled folder made with the ``smollm2`` alias advises the alias,
and ``promptcache --help`` loads no torch."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from promptcache.cli import main
from promptcache.pml import PMLErrors, parse_schema
from promptcache.pml.errors import MAX_ERRORS

ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "PYTHONPATH": str(ROOT)}
THREE_ERRORS = """<schema name="trip">
  <module name="a" cache="maybe">x</module>
  <module name="b">y <parameter name="days" length="-1"/></module>
  <module name="c"><bogus/></module>
  <module name="d">z</module>
  <module name="d">w</module>
</schema>
"""


def test_validate_reports_every_error_of_a_file_in_one_run(tmp_path):
    f = tmp_path / "bad.xml"
    f.write_text(THREE_ERRORS)
    res = CliRunner().invoke(main, ["validate", str(f)])
    assert res.exit_code == 1
    errors = [ln for ln in res.stderr.splitlines() if ln.startswith(str(f))]
    assert [ln.split(":")[1] for ln in errors] == ["2", "3", "4", "6"], res.stderr
    assert "cache='maybe'" in errors[0] and "length '-1'" in errors[1] and "<bogus>" in errors[2]
    assert "duplicate module name 'd'" in errors[3]


def test_errors_of_one_file_are_capped_and_the_rest_counted():
    bad = "".join(f'<module name="m{i}" cache="no">x</module>\n' for i in range(MAX_ERRORS + 5))
    with pytest.raises(PMLErrors) as e:
        parse_schema(f'<schema name="s">\n{bad}</schema>')
    assert len(e.value.errors) == MAX_ERRORS and e.value.more == 5
    assert str(e.value).splitlines()[-1] == "<string>: 5 more errors not shown"
    assert e.value.line == 2  # the first error's place, as a single PMLError has


def test_errors_come_in_line_order_whichever_check_found_them():
    text = ('<schema name="s">\n<module name="a">x</module>\n<module name="a">y</module>\n'
            '<module name="b" cache="no">z</module>\n</schema>')
    with pytest.raises(PMLErrors) as e:
        parse_schema(text)
    assert [x.line for x in e.value.errors] == [3, 4]  # the duplicate (a scope check) before the attribute
    assert "duplicate module name 'a'" in e.value.reason


def test_one_error_is_raised_as_it_is():
    with pytest.raises(Exception) as e:
        parse_schema('<schema name="s"><module name="m" cache="no">x</module></schema>')
    assert type(e.value).__name__ == "PMLError" and "cache='no'" in str(e.value)


def test_help_imports_no_torch_in_a_fresh_process():
    code = ("import sys; from promptcache.cli import main; main(['--help'], standalone_mode=False); "
            "print('torch loaded:', 'torch' in sys.modules)")
    res = subprocess.run([sys.executable, "-c", code], env=ENV, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert "serve " in res.stdout and "validate " in res.stdout  # every command listed, serve included
    assert res.stdout.strip().endswith("torch loaded: False"), res.stdout


@pytest.mark.slow  # converts SmolLM2 on first use (the demo test does too)
def test_an_artifact_compiled_with_the_alias_advises_the_alias(tmp_path):
    out = tmp_path / "c"
    r = CliRunner().invoke(main, ["compile", str(ROOT / "schemas" / "travel.xml"), "--model", "smollm2",
                                  "--dtype", "float32", "--out", str(out)])
    assert r.exit_code == 0, r.output
    # --model says otherwise: refused, the alias advised
    r = CliRunner().invoke(main, ["run", str(ROOT / "examples" / "travel_tokyo.xml"), "--compiled", str(out),
                                  "--model", "embedded"])
    assert r.exit_code == 1
    assert "use it with --model smollm2 --dtype float32" in r.stderr, r.stderr
    # without --model: the model (and dtype) the artifact records, said once
    r = CliRunner().invoke(main, ["run", str(ROOT / "examples" / "travel_tokyo.xml"), "--compiled", str(out),
                                  "--max-new-tokens", "2", "--json"])
    assert r.exit_code == 0, r.stderr
    assert f"model: smollm2 (float32), the model {out} was compiled for (--model chooses another)" in r.stderr
    assert json.loads(r.stdout)["cached_tokens"] > 0


# -- chat: a parameter's scaffold never reaches the model ----------------------------------------
def test_chat_leaves_modules_with_parameters_out_and_never_sends_a_scaffold():
    from promptcache import PromptCache
    from promptcache.cli.chat_session import ChatSession, default_imports, import_tag, left_out, turn_prompt

    pc = PromptCache.from_pretrained("embedded")
    layout = pc.add_schema(ROOT / "schemas" / "travel.xml").layout
    assert default_imports(layout) == ["food", "accessibility"]
    assert left_out(layout, ["food"]) == ["trip (days, travelers)"]
    assert import_tag(layout, "trip") == '<trip days="" travelers=""/>'  # left out: no tokens, no "five"

    session = ChatSession(pc, None, layout, default_imports(layout))
    assert session.command("/use trip days=three food") == "importing trip, food"
    tags = [import_tag(layout, n, session.arguments.get(n)) for n in session.imports]
    text = pc.tokenizer.decode(pc.layout(turn_prompt("travel", tags, [], "Plan one day in Paris.")).token_ids)
    assert "a trip of three days for" in " ".join(text.split())
    assert "five" not in text and "two adults" not in text  # the scaffolds of days and travelers
    assert session.command("/use trip nights=2") == "module 'trip' has no parameter nights (its parameters: days, travelers)"
    too_long = session.command('/use trip days="' + "very " * 10 + 'long"')
    assert "days" in too_long and "4" in too_long, too_long  # the parameter allows 4 tokens: said at /use
    assert session.imports == ["trip", "food"]  # refused /use lines change nothing


def test_validate_reports_every_error_of_a_prompt_file_in_one_run(tmp_path):
    f = tmp_path / "bad_prompt.xml"
    f.write_text('<prompt schema="travel">\n<trip days="3" travelers="two" color="red"/>\n<nosuch/>\n<tokyo/>\n'
                 '<paris/>\n<user>Food?</user>\n</prompt>\n')
    res = CliRunner().invoke(main, ["validate", str(ROOT / "schemas" / "travel.xml"), str(f)])
    assert res.exit_code == 1
    errors = [ln for ln in res.stderr.splitlines() if ln.startswith(str(f))]
    assert [ln.split(":")[1] for ln in errors] == ["2", "3", "5"], res.stderr
    assert "no parameter 'color'" in errors[0] and "unknown module 'nosuch'" in errors[1] and "union" in errors[2]
