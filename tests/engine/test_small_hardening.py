"""Small things from issues 12 and 16: the chat-template fallback is logged once per tokenizer;
files promptcache writes (artifacts, manifests) follow the umask instead of a temporary file's
0600; the engine treats a str prompt as text even when it names a file."""

from __future__ import annotations

import logging
import os

from pathlib import Path

import pytest

from promptcache import PMLError, PromptCache, layout_schema
from promptcache.fsutil import atomic_write
from tiny import make_model, make_tokenizer

ROLES_SCHEMA = '<schema name="r"><system>Be brief.</system><user><module name="m">Some text here.</module></user></schema>'


def fallbacks(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.levelno == logging.WARNING and "has no chat template" in r.getMessage()]


def test_missing_chat_template_is_logged_once_per_tokenizer(caplog):
    caplog.set_level(logging.WARNING, logger="promptcache.tokens")
    plain = make_tokenizer.__wrapped__(chat=False)  # a fresh object: the cached one may have warned already
    layout_schema(ROLES_SCHEMA, plain)
    layout_schema(ROLES_SCHEMA.replace("Be brief.", "Be kind."), plain)
    assert len(fallbacks(caplog)) == 1 and "System: ..." in fallbacks(caplog)[0]
    layout_schema(ROLES_SCHEMA, make_tokenizer.__wrapped__(chat=False))  # another tokenizer: warned too
    assert len(fallbacks(caplog)) == 2
    layout_schema(ROLES_SCHEMA, make_tokenizer.__wrapped__(chat=True))  # a template: nothing to say
    layout_schema('<schema name="n">No roles at all.</schema>', make_tokenizer.__wrapped__(chat=False))
    assert len(fallbacks(caplog)) == 2


def _modes(folder) -> dict[str, int]:
    return {p.name: p.stat().st_mode & 0o777 for p in folder.iterdir() if p.is_file() and p.name != ".lock"}


def test_written_files_follow_the_umask(tmp_path):
    old = os.umask(0o027)
    try:
        assert atomic_write(tmp_path / "a.bin", b"x").stat().st_mode & 0o777 == 0o640
        PromptCache(make_model("llama", 0), make_tokenizer()).compile(ROLES_SCHEMA, tmp_path / "art")
        os.umask(0o002)
        PromptCache(make_model("llama", 0), make_tokenizer()).compile(ROLES_SCHEMA, tmp_path / "art2")
    finally:
        os.umask(old)
    first, second = _modes(tmp_path / "art"), _modes(tmp_path / "art2")
    assert "manifest.json" in first and len(first) >= 2  # the manifest and the states file
    assert set(first.values()) == {0o640} and set(second.values()) == {0o664}


def test_engine_str_is_text_and_path_is_a_file(tmp_path, monkeypatch):
    (tmp_path / "travel").write_text('<prompt schema="r"><m/></prompt>')
    (tmp_path / "r.xml").write_text(ROLES_SCHEMA)
    monkeypatch.chdir(tmp_path)
    pc = PromptCache(make_model("llama", 0), make_tokenizer())
    with pytest.raises(PMLError, match="pathlib.Path"):
        pc.add_schema("r.xml")  # a str is PML text, not a file name
    pc.add_schema(Path("r.xml"))
    as_text = pc.prefill("travel")  # the word, not the file
    assert as_text.cached_tokens == 0 and pc.layout("travel").token_ids[1:] == make_tokenizer().encode(
        "travel", add_special_tokens=False)
    assert pc.prefill(Path("travel")).cached_tokens > 0  # the file: a prompt importing module m
