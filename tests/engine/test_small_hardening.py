"""Small things from issue 16: the chat-template fallback is logged once per tokenizer; files
promptcache writes (artifacts, manifests) follow the umask instead of a temporary file's 0600."""

from __future__ import annotations

import logging
import os

from promptcache import PromptCache, layout_schema
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
