"""Hostile PML: a seeded fuzzer over schemas and prompts (byte flips, DTDs, odd ``src`` values,
surrogates, markup fragments, huge lengths). Every input either parses and lays out, or raises
``PMLError``; nothing else escapes, and no file outside the schema's folder is ever read.

Also the ``src`` confinement and file-type rules one by one (issue: hostile PML).
"""

from __future__ import annotations

import os
import random

import pytest

from promptcache import PMLError, layout_prompt, layout_schema, parse_prompt, parse_schema
from promptcache.pml.source import MAX_FILE_BYTES
from promptcache.tokens import WordTokenizer

SECRET = "SECRET-MARKER-42"

SCHEMAS = [
    '<schema name="s">Intro <module name="a">Alpha <parameter name="p" length="3" scaffold="x"/> end</module>'
    '<union scaffold="b"><module name="b">Beta</module><module name="c">Gamma delta</module></union>'
    '<module name="f" src="doc.txt"/> tail</schema>',
    '<schema name="s"><system>Be brief. <module name="a">A <module name="n">nested</module></module></system>'
    '<user><module name="q" cache="false">Q?</module></user></schema>',
    '<schema name="s">\n  <module name="a">\n    def f():\n        return 1\n  </module>\n  <module name="b">B</module>\n</schema>',
]
PROMPTS = [
    '<prompt schema="s"><a p="1 2"/><c/> What now?</prompt>',
    '<prompt schema="s"><a><n/></a><user>and more</user></prompt>',
    '<prompt schema="s">lead <b/> mid <a p=""/> end</prompt>',
    "plain text prompt",
]
ODD_SRC = [
    "/etc/passwd", "/etc/hostname", "../outside/secret.txt", "../../../../etc/passwd", "/proc/self/environ",
    "/dev/zero", "fifo", "link_out", "link_zero", "", " ", ".", "..", "sub/", "doc.txt\x00x", "doc.txt/..",
    "\ud800", "a" * 5000, "%2e%2e/outside/secret.txt", "big.txt", "bad_utf8.txt", "doc.txt",
]
FRAGMENTS = [
    '<!DOCTYPE schema [<!ENTITY e "x">]>', '<!DOCTYPE schema [<!ATTLIST module src CDATA "/etc/hostname">]>',
    '<!DOCTYPE prompt SYSTEM "file:///etc/passwd">', "&e;", "&amp;", "<", "&", "]]>", "<![CDATA[<x>]]>",
    "<!-- c -->", "<?pi x?>", '<parameter name="q" length="1000000"/>', '<module name="z"/>', "<union>",
    "</module>", '<a p="' + "w " * 300 + '"/>', "\ud800", "\udfff", "\x00", "\x0b", "\ufeff", "\U0001f600",
    '<module name="x" src="/etc/passwd"/>', 'src="../outside/secret.txt"', "<user>", "</user>", "<b/>",
]


@pytest.fixture
def folders(tmp_path, monkeypatch):
    root, outside = tmp_path / "root", tmp_path / "outside"
    (root / "sub").mkdir(parents=True)
    outside.mkdir()
    (outside / "secret.txt").write_text(SECRET)
    (root / "doc.txt").write_text("A document.")
    (root / "sub" / "doc.txt").write_text("A document beside the schema file.")
    (root / "bad_utf8.txt").write_bytes(b"\xff\xfe bad")
    with open(root / "big.txt", "wb") as f:
        f.truncate(MAX_FILE_BYTES + 1)  # sparse: no disk used
    os.mkfifo(root / "fifo")
    os.symlink(outside / "secret.txt", root / "link_out")
    os.symlink("/dev/zero", root / "link_zero")
    monkeypatch.chdir(root)  # a schema given as a string reads src relative to the working directory
    return root


def _mutate(rng: random.Random, text: str) -> str:
    for _ in range(rng.randint(1, 3)):
        op = rng.randrange(7)
        if op == 0 and text:  # flip one byte; undecodable bytes become lone surrogates
            data = bytearray(text.encode("utf-8", "surrogatepass"))
            data[rng.randrange(len(data))] = rng.randrange(256)
            text = data.decode("utf-8", "surrogateescape")
        elif op == 1:
            at = rng.randint(0, len(text))
            text = text[:at] + rng.choice(FRAGMENTS) + text[at:]
        elif op == 2:
            text = rng.choice(FRAGMENTS[:3]) + "\n" + text
        elif op == 3 and 'src="' in text:
            text = text.replace('src="doc.txt"', f"src={_quote(rng.choice(ODD_SRC))}", 1)
        elif op == 4:
            text = text.replace('<module name="b">', f'<module name="b" src={_quote(rng.choice(ODD_SRC))}/><module name="bb">', 1)
        elif op == 5 and text:
            a = rng.randrange(len(text))
            text = text[:a] + text[a + rng.randint(1, 8):]
        elif op == 6:
            text = text.replace('length="3"', f'length="{rng.choice(["0", "-1", "1000000", "99999999999", "3.5", "x"])}"')
    return text


def _quote(value: str) -> str:
    return '"' + value.replace("&", "&amp;").replace('"', "&quot;").replace("<", "&lt;") + '"'


def _check_no_secret(schema) -> None:
    def walk(children):
        for c in children:
            assert SECRET not in getattr(c, "text", ""), "a file outside the allowed root was read"
            for attr in ("children", "members"):
                walk(getattr(c, attr, []))

    walk(schema.children)


def test_fuzz_only_pml_errors(folders):
    rng = random.Random(1234)
    tok = WordTokenizer()
    counts = {"inputs": 0, "ok": 0, "refused": 0}
    for i in range(1600):
        text = _mutate(rng, rng.choice(SCHEMAS))
        as_file = i % 3 == 0
        if as_file:
            path = folders / "sub" / "s.xml"
            path.write_bytes(text.encode("utf-8", "surrogatepass"))  # a lone surrogate: invalid UTF-8
        limit = rng.choice([None, 16, 4096])
        counts["inputs"] += 1
        try:
            tree = parse_schema(path if as_file else text)
            _check_no_secret(tree)
            lay = layout_schema(tree, tok, max_positions=limit)
        except PMLError:
            counts["refused"] += 1
            continue
        counts["ok"] += 1
        for _ in range(2):
            prompt = _mutate(rng, rng.choice(PROMPTS))
            counts["inputs"] += 1
            try:
                layout_prompt(parse_prompt(prompt), lay, tok, max_positions=limit)
                counts["ok"] += 1
            except PMLError:
                counts["refused"] += 1
    assert counts["inputs"] >= 2000
    assert counts["ok"] > 200 and counts["refused"] > 200  # the fuzzer reaches both outcomes


@pytest.mark.parametrize(
    "src, reason",
    [
        ("/etc/hostname", "outside the allowed folder"),
        ("../outside/secret.txt", "outside the allowed folder"),
        ("link_out", "outside the allowed folder"),  # a symlink is judged by where it points
        ("fifo", "is not a regular file"),  # refused at once, no hang
        ("sub", "is not a regular file"),
        ("big.txt", f"more than the limit of {MAX_FILE_BYTES}"),
        ("bad_utf8.txt", "is not UTF-8"),
        ("missing.txt", "cannot be read"),
    ],
)
def test_src_is_confined_to_the_schema_folder(folders, src, reason):
    path = folders / "s.xml"
    path.write_text(f'<schema name="s">\n<module name="m" src="{src}"/>\n</schema>')
    with pytest.raises(PMLError) as e:
        parse_schema(path)
    assert reason in str(e.value) and (e.value.source, e.value.line) == (str(path), 2), str(e.value)


def test_allow_src_root_widens_the_folder_and_strings_use_the_working_directory(folders):
    sub = folders / "sub"
    (sub / "s.xml").write_text('<schema name="s"><module name="m" src="../doc.txt"/></schema>')
    with pytest.raises(PMLError, match="outside the allowed folder"):
        parse_schema(sub / "s.xml")
    (m,) = parse_schema(sub / "s.xml", allow_src_root=folders).children
    assert m.children[0].text == "A document."
    (m,) = parse_schema('<schema name="s"><module name="m" src="doc.txt"/></schema>').children  # cwd = root
    assert m.children[0].text == "A document."
    lay = layout_schema('<schema name="s"><module name="m" src="../outside/secret.txt"/></schema>', WordTokenizer(),
                        allow_src_root=folders.parent)
    assert lay.modules[("m",)].end > 0
    with pytest.raises(PMLError, match="is not a regular file"):  # even under a wide root: no devices
        parse_schema('<schema name="s"><module name="m" src="/dev/zero"/></schema>', allow_src_root="/")


def test_a_dtd_attribute_default_never_adds_src(folders):
    text = '<!DOCTYPE schema [<!ATTLIST module src CDATA "/etc/hostname">]><schema name="s"><module name="m">x</module></schema>'
    with pytest.raises(PMLError, match="DOCTYPE is not allowed"):
        parse_schema(text)
    text = '<!DOCTYPE prompt [<!ENTITY e "expanded">]><prompt schema="s"><m a="&e;"/></prompt>'
    with pytest.raises(PMLError, match="DOCTYPE is not allowed"):
        parse_prompt(text)
