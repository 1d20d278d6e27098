"""A ``str`` is always PML or plain text and never opened; a ``pathlib.Path`` (os.PathLike) is a
file (issue 12: a string prompt that happened to name a file was read from disk)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from promptcache import PMLError, PromptCacheError, parse_prompt, parse_schema
from promptcache.pml import SourceFileError
from promptcache.pml.nodes import Text


@pytest.fixture
def no_file_access(monkeypatch):
    """Every way the parser could open a file fails the test."""

    def refuse(*a, **k):
        raise AssertionError(f"a file was opened: {a[:1]}")

    monkeypatch.setattr(os, "open", refuse)
    monkeypatch.setattr(Path, "read_bytes", refuse)
    monkeypatch.setattr(Path, "read_text", refuse)
    monkeypatch.setattr("builtins.open", refuse)


def test_a_str_naming_an_existing_file_is_a_plain_prompt_and_never_opened(tmp_path, monkeypatch, no_file_access):
    (tmp_path / "travel").write_bytes(b"\xff\xfe not UTF-8, would be an error if read")
    monkeypatch.chdir(tmp_path)
    for text in ("travel", "/etc/passwd", str(tmp_path / "travel")):
        p = parse_prompt(text)
        assert p.schema is None and p.source == "<string>"
        assert [c.text for c in p.children if isinstance(c, Text)] == [text]


def test_a_str_schema_is_text_and_its_error_does_not_tell_whether_a_file_exists(tmp_path, no_file_access):
    errors = []
    for name in ("/etc/passwd", str(tmp_path / "no-such-file.xml")):
        with pytest.raises(PMLError) as e:
            parse_schema(name)
        errors.append(e.value.reason)
        assert e.value.source == "<string>" and "pathlib.Path" in e.value.reason
    assert errors[0] == errors[1]  # the same words whether the file exists or not


def test_a_path_is_read(tmp_path):
    (tmp_path / "s.xml").write_text('<schema name="s"><module name="a">A</module></schema>')
    (tmp_path / "p.xml").write_text('<prompt schema="s"><a/></prompt>')
    (tmp_path / "plain.txt").write_text("What is the capital of France?")
    assert parse_schema(tmp_path / "s.xml").source == str(tmp_path / "s.xml")
    assert parse_prompt(tmp_path / "p.xml").schema == "s"
    plain = parse_prompt(tmp_path / "plain.txt")  # a file's text follows the same rule as a str
    assert plain.schema is None and plain.children[0].text == "What is the capital of France?"

    class Named(os.PathLike):  # any os.PathLike is a file
        def __fspath__(self):
            return str(tmp_path / "s.xml")

    assert parse_schema(Named()).name == "s"


def test_a_missing_path_is_named_and_is_an_environment_error(tmp_path):
    for parse, kind in ((parse_schema, "schema"), (parse_prompt, "prompt")):
        with pytest.raises(SourceFileError) as e:
            parse(tmp_path / "gone.xml")
        assert f"{kind} file '{tmp_path / 'gone.xml'}' cannot be read" in str(e.value)
        assert isinstance(e.value, PMLError) and isinstance(e.value, PromptCacheError)
        assert e.value.exit_code == 2


def test_an_empty_file_is_an_empty_prompt(tmp_path):
    (tmp_path / "empty.txt").write_text("  \n")
    with pytest.raises(PMLError, match="empty prompt") as e:
        parse_prompt(tmp_path / "empty.txt")
    assert e.value.source == str(tmp_path / "empty.txt") and e.value.exit_code == 1


def test_other_types_are_refused():
    for bad in (b"<schema name='s'>x</schema>", 3, None):
        with pytest.raises(TypeError, match="pathlib.Path"):
            parse_schema(bad)
        with pytest.raises(TypeError, match="pathlib.Path"):
            parse_prompt(bad)
