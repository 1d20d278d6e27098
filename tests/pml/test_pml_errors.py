"""Every bad input is a PMLError naming the source, the right line and what is wrong."""

import pytest

from pml_tokenizers import ToyTokenizer
from promptcache import PMLError, layout_prompt, layout_schema, parse_prompt, parse_schema
from promptcache.pml.errors import MAX_ERRORS, PMLErrors


def check(err: PMLError, source: str, line: int, *fragments: str) -> None:
    msg = str(err)
    assert isinstance(err, PMLError)
    assert msg.startswith(f"{source}:{line}: "), msg
    assert (err.source, err.line) == (source, line)
    for f in fragments:
        assert f in msg, f"{f!r} not in {msg!r}"


def schema_error(text: str) -> PMLError:
    with pytest.raises(PMLError) as e:
        layout_schema(parse_schema(text), ToyTokenizer())
    return e.value


# (schema text, line, fragments): the bad construct is always on the line named
SCHEMA_ERRORS = {
    "malformed: tag mismatch": (
        '<schema name="s">\n<module name="a">\ntext\n</schema>',
        4,
        ["malformed XML", "Opening and ending tag mismatch: module line 2 and schema"],
    ),
    "malformed: unclosed attribute quote": (
        '<schema name="s">\n\n<module name="a>x</module>\n</schema>',
        3,  # lxml's line: where it met the '<' inside the runaway value
        ["malformed XML"],
    ),
    "malformed: bare ampersand": (
        '<schema name="s">\nA & B\n</schema>',
        2,
        ["malformed XML", "xmlParseEntityRef", "use &lt;, &amp; or CDATA, or src="],
    ),
    "malformed: content after the root": (
        '<schema name="s">x</schema>\n<schema name="t"/>',
        2,
        ["malformed XML", "Extra content at the end of the document"],
    ),
    "empty text": ("  ", 1, ["empty schema"]),
    "malformed: no root element": ("<!-- nothing -->", 1, ["malformed XML"]),
    "wrong root": ('\n<prompt schema="s"/>', 2, ["expected <schema> as the root element, found <prompt>"]),
    "schema without name": ("<schema>\n</schema>", 1, ["<schema> needs attribute 'name'"]),
    "missing length": (
        '<schema name="s">\n<module name="m">\n<parameter name="days"/>\n</module>\n</schema>',
        3,
        ["<parameter> needs attribute 'length'"],
    ),
    "module without name": ('<schema name="s">\n\n<module>x</module></schema>', 3, ["<module> needs attribute 'name'"]),
    "duplicate module names": (
        '<schema name="s">\n<module name="a">x</module>\n<module name="a">y</module>\n</schema>',
        3,
        ["duplicate module name 'a'", "first at line 2"],
    ),
    "duplicate module name with a union member": (
        '<schema name="s">\n<module name="a">x</module>\n<union>\n<module name="b">y</module>\n'
        '<module name="a">z</module>\n</union>\n</schema>',
        5,
        ["duplicate module name 'a'"],
    ),
    "duplicate union members": (
        '<schema name="s"><union>\n<module name="a">y</module>\n<module name="a">z</module>\n</union></schema>',
        3,
        ["duplicate module name 'a'"],
    ),
    "duplicate module names across roles": (
        '<schema name="s">\n<system><module name="a">x</module></system>\n<user>\n<module name="a">y</module>'
        "</user></schema>",
        4,
        ["duplicate module name 'a'"],
    ),
    "duplicate nested module names": (
        '<schema name="s"><module name="m">\n<module name="a">x</module>\n<module name="a">y</module>\n'
        "</module></schema>",
        3,
        ["duplicate module name 'a'"],
    ),
    "duplicate parameter names": (
        '<schema name="s"><module name="m">\n<parameter name="p" length="1"/>\n'
        '<parameter name="p" length="2"/></module></schema>',
        3,
        ["duplicate parameter name 'p'", "first at line 2"],
    ),
    "parameter in the schema root": (
        '<schema name="s">\n  text\n  <parameter name="p" length="2"/>\n</schema>',
        3,
        ["parameter 'p' outside a module"],
    ),
    "parameter directly in a role": (
        '<schema name="s">\n<user>\n<parameter name="p" length="2"/></user></schema>',
        3,
        ["parameter 'p' outside a module"],
    ),
    "parameter directly in a union": (
        '<schema name="s"><union>\n<module name="a">y</module>\n<parameter name="p" length="2"/></union></schema>',
        3,
        ["<parameter> inside <union>"],
    ),
    "parameter with content": (
        '<schema name="s"><module name="m">\n<parameter name="p" length="2">x</parameter></module></schema>',
        2,
        ["<parameter name='p'> must be empty"],
    ),
    "unknown tag": ('<schema name="s">\n<module name="m">\n<b>bold</b></module></schema>', 3, ["unknown tag <b>"]),
    "nested schema tag": ('<schema name="s">\n<schema name="t"/></schema>', 2, ["unknown tag <schema>"]),
    "unknown attribute on module": (
        '<schema name="s">\n<module name="m" colour="red">x</module></schema>',
        2,
        ["<module> has unknown attribute 'colour'", "allowed: cache, name, src"],
    ),
    "unknown attribute on union": (
        '<schema name="s">\n<union default="a"><module name="a">x</module></union></schema>',
        2,
        ["<union> has unknown attribute 'default'"],
    ),
    # a start tag over several lines: the error names the line the tag starts on
    "unknown attribute on schema": ('<schema name="s"\n version="2">x</schema>', 1, ["unknown attribute 'version'"]),
    "bad cache value in a long start tag": (
        '<schema name="s">\n<module\n  name="m"\n  cache="maybe">x</module></schema>',
        2,
        ["cache='maybe'"],
    ),
    "unknown attribute on role": ('<schema name="s">\n<user name="bob">x</user></schema>', 2, ["<user> has unknown attribute 'name'"]),
    "unknown attribute on parameter": (
        '<schema name="s"><module name="m">\n<parameter name="p" length="2" size="3"/></module></schema>',
        2,
        ["<parameter> has unknown attribute 'size'"],
    ),
    "bad cache value": (
        '<schema name="s">\n<module name="m" cache="maybe">x</module></schema>',
        2,
        ["module 'm' has cache='maybe': expected true or false"],
    ),
    "scaffold naming a non-member": (
        '<schema name="s">\n<union scaffold="rome">\n<module name="paris">x</module>\n'
        '<module name="tokyo">y</module>\n</union></schema>',
        2,
        ["union scaffold 'rome' is not one of its members (paris, tokyo)"],
    ),
    "empty union": ('<schema name="s">\n<union>\n</union></schema>', 2, ["<union> has no <module> members"]),
    "text inside a union": (
        '<schema name="s"><union>\n<module name="a">x</module>\n  stray text\n</union></schema>',
        3,
        ["text inside <union>"],
    ),
    "role inside a module": (
        '<schema name="s"><module name="m">\n<user>x</user></module></schema>',
        2,
        ["<user> must be at the top level"],
    ),
    "content outside roles": (
        '<schema name="s">\n<system>x</system>\n\n  loose text\n<user>y</user></schema>',
        4,
        ["content outside a role"],
    ),
    "module outside roles": (
        '<schema name="s">\n<system>x</system>\n<module name="m">y</module></schema>',
        3,
        ["content outside a role"],
    ),
    "invalid module name": ('<schema name="s">\n<module name="2fast">x</module></schema>', 2, ["module name '2fast'"]),
    "reserved module name": ('<schema name="s">\n<module name="user">x</module></schema>', 2, ["reserved"]),
    "doctype with an entity": (
        '\n<!DOCTYPE schema [<!ENTITY co "ACME">]>\n<schema name="s">\nWelcome to &co;</schema>',
        2,
        ["a DOCTYPE is not allowed"],
    ),
    "doctype with an attribute default": (
        '<!DOCTYPE schema [<!ATTLIST module src CDATA "/etc/hostname">]>\n<schema name="s">\n'
        '<module name="m">x</module></schema>',
        1,
        ["a DOCTYPE is not allowed"],
    ),
    "empty schema": ('<schema name="e">\n  \n</schema>', 1, ["schema 'e' is empty"]),
    "bare less-than in text": (
        '<schema name="s">\n<module name="m">if a < b</module></schema>',
        2,
        ["malformed XML", "use &lt;, &amp; or CDATA, or src="],
    ),
    "scaffold longer than the slot": (
        '<schema name="s"><module name="m">\n<parameter name="p" length="2" scaffold="one two three"/></module>'
        "</schema>",
        2,
        ["scaffold is 3 tokens, the parameter allows 2"],
    ),
}

LENGTHS = ["four", "-1", "0", "2.5", "", "²", "1e3", "0x10", "99999999999999"]


@pytest.mark.parametrize("case", list(SCHEMA_ERRORS))
def test_schema_errors(case):
    text, line, fragments = SCHEMA_ERRORS[case]
    check(schema_error(text), "<string>", line, *fragments)


@pytest.mark.parametrize("length", LENGTHS)
def test_non_integer_length(length):
    err = schema_error(f'<schema name="s"><module name="m">\n\n<parameter name="p" length="{length}"/></module></schema>')
    check(err, "<string>", 3, f"parameter 'p' has length '{length}': expected a positive integer")


def test_schema_errors_name_the_file(tmp_path):
    path = tmp_path / "bad.xml"
    path.write_text('<schema name="s">\n<module name="m">\n<parameter name="p" length="x"/></module></schema>')
    with pytest.raises(PMLError) as e:
        parse_schema(path)
    check(e.value, str(path), 3, "length 'x'")
    path.write_text('<schema name="s">\n\n<module name="m">oops</schema>')
    with pytest.raises(PMLError) as e:
        parse_schema(path)
    check(e.value, str(path), 3, "malformed XML")


def test_src_file_missing(tmp_path):
    path = tmp_path / "s.xml"
    path.write_text('<schema name="s">\n<module name="a">x</module>\n<module name="b" src="nope/b.py"/>\n</schema>')
    with pytest.raises(PMLError) as e:
        parse_schema(path)
    check(e.value, str(path), 3, "src file", "nope/b.py", "cannot be read")


def test_src_file_not_utf8(tmp_path):
    (tmp_path / "b.txt").write_bytes(b"caf\xe9\n")
    path = tmp_path / "s.xml"
    path.write_text('<schema name="s">\n<module name="b" src="b.txt"/>\n</schema>')
    with pytest.raises(PMLError) as e:
        parse_schema(path)
    check(e.value, str(path), 2, "b.txt", "not UTF-8")


def test_src_with_content(tmp_path):
    (tmp_path / "b.txt").write_text("B")
    path = tmp_path / "s.xml"
    path.write_text('<schema name="s">\n<module name="b" src="b.txt">and text</module>\n</schema>')
    with pytest.raises(PMLError) as e:
        parse_schema(path)
    check(e.value, str(path), 2, "module 'b' has both src= and content")


def test_schema_file_missing_or_not_utf8(tmp_path):
    with pytest.raises(PMLError, match="schema file '.*missing.xml' cannot be read \\(No such file"):
        parse_schema(tmp_path / "missing.xml")
    (tmp_path / "latin.xml").write_bytes(b'<schema name="s">caf\xe9</schema>')
    with pytest.raises(PMLError, match="not UTF-8"):
        parse_schema(tmp_path / "latin.xml")


# ---------------------------------------------------------------------------------------------
# Prompts

SCHEMA = """<schema name="travel">
  <module name="plan">Plan a trip of <parameter name="days" length="2"/> days.
    <module name="detail">In detail.</module>
  </module>
  <union scaffold="paris">
    <module name="paris">Paris.</module>
    <module name="tokyo">Tokyo.</module>
  </union>
</schema>"""


def prompt_error(text: str, schema: str | None = SCHEMA, source: str = "<string>") -> PMLError:
    tok = ToyTokenizer()
    with pytest.raises(PMLError) as e:
        layout_prompt(parse_prompt(text), layout_schema(schema, tok) if schema else None, tok)
    return e.value


PROMPT_ERRORS = {
    "malformed": ('<prompt schema="travel">\n<plan days="3">\n</prompt>', 3, ["malformed XML", "mismatch"]),
    "malformed: unquoted attribute": ('<prompt schema="travel">\n<plan days=3/>\n</prompt>', 2, ["malformed XML"]),
    "wrong root": ('<schema name="travel"/>', 1, ["expected <prompt> as the root element"]),
    "unknown prompt attribute": ('\n<prompt schema="travel" model="x"/>', 2, ["<prompt> has unknown attribute 'model'"]),
    "unknown module": (
        '<prompt schema="travel">\n<plan days="3"/>\n<rome/>\n</prompt>',
        3,
        ["unknown module 'rome' at the top level of schema 'travel'", "known: paris, plan, tokyo"],
    ),
    "nested module at the top level": (
        '<prompt schema="travel">\n\n<detail/>\n</prompt>',
        3,
        ["unknown module 'detail' at the top level"],
    ),
    "unknown nested module": (
        '<prompt schema="travel">\n<plan days="3">\n  <paris/>\n</plan></prompt>',
        3,
        ["unknown module 'paris' inside 'plan'", "known: detail"],
    ),
    "unknown parameter": (
        '<prompt schema="travel">\n<tokyo/>\n<plan days="3" nights="2"/>\n</prompt>',
        3,
        ["module 'plan' has no parameter 'nights' (parameters: days)"],
    ),
    "argument for a module without parameters": (
        '<prompt schema="travel">\n<tokyo days="3"/></prompt>',
        2,
        ["module 'tokyo' has no parameter 'days' (parameters: none)"],
    ),
    "missing argument": (
        '<prompt schema="travel">\n<tokyo/>\n\n<plan/>\n</prompt>',
        4,
        ["module 'plan' needs an argument for parameter(s): days"],
    ),
    "two members of one union": (
        '<prompt schema="travel">\n<paris/>\n<tokyo/>\n</prompt>',
        3,
        ["two members of one union imported: 'paris' and 'tokyo'"],
    ),
    "imported twice": ('<prompt schema="travel">\n<paris/>\n<paris/>\n</prompt>', 3, ["module 'paris' imported twice"]),
    "argument longer than its slot": (
        '<prompt schema="travel">\n<tokyo/>\n<plan days="three or four"/>\n</prompt>',
        3,
        ["argument 'days' of module 'plan' is 3 tokens, the parameter allows 2"],
    ),
    "text inside a module reference": (
        '<prompt schema="travel">\n<plan days="3">\n  please\n</plan>\n</prompt>',
        3,
        ["text inside the module reference <plan>"],
    ),
    "text after a nested reference": (
        '<prompt schema="travel">\n<plan days="3">\n  <detail/>\n  <!-- c -->\n  please</plan>\n</prompt>',
        5,
        ["text inside the module reference <plan>"],
    ),
    "text before a multi-line nested reference": (
        '<prompt schema="travel"><plan days="3">\n  please\n  <detail\n    /></plan>\n</prompt>',
        2,
        ["text inside the module reference <plan>"],
    ),
    "text after a multi-line nested reference": (
        '<prompt schema="travel"><plan\n days="3"><detail\n\n/>\n  please</plan>\n</prompt>',
        5,
        ["text inside the module reference <plan>"],
    ),
    "text after a closing tag on its own line": (
        '<prompt schema="travel">\n<plan days="3">\n<detail>\n\n</detail\n\n>  please</plan>\n</prompt>',
        7,
        ["text inside the module reference <plan>"],
    ),
    "schema tag in a prompt": ('<prompt schema="travel">\n<module name="x"/></prompt>', 2, ["<module> is a schema tag"]),
    "role inside a reference": (
        '<prompt schema="travel">\n<plan days="3">\n<user/></plan></prompt>',
        3,
        ["<user> must be at the top level of the prompt"],
    ),
    "role inside a role": ('<prompt schema="travel">\n<user>\n<system>x</system></user></prompt>', 3, ["<system> must be at the top level"]),
    "role with attributes": ('<prompt schema="travel">\n<user name="x">hi</user></prompt>', 2, ["<user> takes no attributes"]),
    "prompt for another schema": ('\n\n<prompt schema="food"><x/></prompt>', 3, ["prompt is for schema 'food', not 'travel'"]),
    "doctype": (
        '<!DOCTYPE prompt [<!ENTITY x "y">]>\n<prompt schema="travel">\n&x;</prompt>',
        1,
        ["a DOCTYPE is not allowed"],
    ),
}


@pytest.mark.parametrize("case", list(PROMPT_ERRORS))
def test_prompt_errors(case):
    text, line, fragments = PROMPT_ERRORS[case]
    check(prompt_error(text), "<string>", line, *fragments)


def test_unknown_schema():
    err = prompt_error('\n<prompt schema="travel">\n<plan days="3"/></prompt>', schema=None)
    check(err, "<string>", 2, "unknown schema 'travel'")


def test_module_reference_without_schema():
    err = prompt_error("<prompt>\nHello\n<plan/></prompt>", schema=None)
    check(err, "<string>", 3, "module reference <plan> in a prompt without schema=")


def test_prompt_errors_name_the_file(tmp_path):
    path = tmp_path / "p.xml"
    path.write_text('<prompt schema="travel">\n<paris/>\n<tokyo/>\n</prompt>')
    tok = ToyTokenizer()
    with pytest.raises(PMLError) as e:
        layout_prompt(path, layout_schema(SCHEMA, tok), tok)
    check(e.value, str(path), 3, "two members of one union")
    with pytest.raises(PMLError, match="prompt file '.*missing.xml' cannot be read \\(No such file"):
        parse_prompt(tmp_path / "missing.xml")


def test_errors_are_value_errors_with_attributes():
    err = schema_error('<schema name="s">\n<module name="m" cache="no">x</module></schema>')
    assert isinstance(err, ValueError)
    assert err.reason == "module 'm' has cache='no': expected true or false"


def test_every_error_of_a_prompt_is_reported_in_line_order():
    """As for a schema: imports and argument lengths all checked, one line each (validate prints them)."""
    text = ('<prompt schema="travel">\n<plan days="three or four" nights="2"/>\n<rome/>\n<paris/>\n<tokyo/>\n'
            '<paris/>\n</prompt>')
    err = prompt_error(text)
    assert isinstance(err, PMLErrors)
    got = [(e.line, e.reason) for e in err.errors]
    assert [line for line, _ in got] == [2, 3, 5, 6]
    assert "has no parameter 'nights'" in got[0][1] and "unknown module 'rome'" in got[1][1]
    assert "two members of one union imported: 'paris' and 'tokyo'" in got[2][1]
    assert "module 'paris' imported twice" in got[3][1]
    assert str(err).splitlines() == [f"<string>:{line}: {reason}" for line, reason in got]
    # a reference that is valid apart from an argument too long: its length is checked too
    err = prompt_error('<prompt schema="travel">\n<plan days="three or four"/>\n<rome/>\n</prompt>')
    assert [e.line for e in err.errors] == [2, 3] and "the parameter allows 2" in err.errors[0].reason


def test_a_prompt_with_more_errors_than_shown_counts_the_rest():
    refs = "\n".join(f"<nosuch{i}/>" for i in range(MAX_ERRORS + 5))
    err = prompt_error(f'<prompt schema="travel">\n{refs}\n</prompt>')
    assert len(err.errors) == MAX_ERRORS and err.more == 5
    assert str(err).splitlines()[-1] == "<string>: 5 more errors not shown"
