"""Every shipped schema and example prompt parses and lays out (WordTokenizer, no model)."""

from pathlib import Path

import pytest

import promptcache
from promptcache import layout_prompt, layout_schema, parse_prompt, parse_schema
from promptcache.tokens import WordTokenizer

ROOT = Path(__file__).resolve().parents[2]
SCHEMAS = sorted((ROOT / "schemas").glob("*.xml"))
PROMPTS = sorted((ROOT / "examples").glob("*.xml"))


def test_there_are_shipped_schemas_and_prompts():
    names = {p.stem for p in SCHEMAS}
    assert {"travel", "code_assistant", "persona", "long_doc_qa", "tutoring"} <= names
    for name in names:
        assert any(p.stem.startswith(name + "_") for p in PROMPTS), f"no example prompt for schema {name}"


@pytest.mark.parametrize("path", SCHEMAS, ids=lambda p: p.name)
def test_schema_lays_out_and_prints(path, capsys):
    schema = parse_schema(path)
    assert schema.name == path.stem
    lay = layout_schema(schema, WordTokenizer())
    assert lay.end > 0 and lay.modules
    assert lay.passes()[0].key == ()
    promptcache.print_layout(path)
    out = capsys.readouterr().out
    assert out.startswith(f"schema '{schema.name}': {lay.stored_tokens} tokens stored, positions [0, {lay.end})")
    assert all(f"{'/'.join(p)} " in out for p in lay.modules)


@pytest.mark.parametrize("path", PROMPTS, ids=lambda p: p.name)
def test_example_prompt_lays_out(path):
    prompt = parse_prompt(path)
    assert prompt.schema is not None and path.stem.startswith(prompt.schema + "_")
    tok = WordTokenizer()
    lay = layout_schema(ROOT / "schemas" / f"{prompt.schema}.xml", tok)
    pl = layout_prompt(prompt, lay, tok)
    assert pl.imports and pl.new, "an example should import modules and add text"
    cached = [p for s in pl.spans if s.schema_index is not None for p in s.position_ids]
    assert len(cached) == len(set(cached))
