"""Parsing schemas and prompts into trees: every tag and attribute, and the whitespace rule.

Language layer only: these tests must not import torch.
"""

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from promptcache.pml import (
    Module,
    ModuleRef,
    Parameter,
    PMLError,
    Prompt,
    PromptRole,
    Role,
    Text,
    Union,
    parse_prompt,
    parse_schema,
)

REPO = Path(__file__).resolve().parents[2]


def texts(children) -> list[str]:
    """The texts of a flat children list, in order."""
    return [c.text for c in children if isinstance(c, Text)]


def test_language_layer_imports_without_torch():
    code = textwrap.dedent(
        """
        import sys
        import promptcache, promptcache.pml, promptcache.layout, promptcache.tokens
        promptcache.print_layout('<schema name="s">hi</schema>')
        assert 'torch' not in sys.modules, 'torch was imported'
        assert 'transformers' not in sys.modules, 'transformers was imported'
        """
    )
    r = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr


# ---------------------------------------------------------------------------------------------
# Schemas: tags and attributes


def test_schema_name_and_anonymous_text():
    s = parse_schema('<schema name="travel">You are a planner.</schema>')
    assert s.name == "travel"
    assert s.source == "<string>"
    assert s.children == [Text("You are a planner.", 1)]
    assert s.roles == ()


def test_module_attributes_and_nesting():
    s = parse_schema(
        """<schema name="s">
  <module name="plan">Plan it.
    <module name="detail" cache="false">Add detail.</module>
  </module>
  <module name="extra" cache="true">Extra.</module>
  <module name="caps" cache=" FALSE ">Caps.</module>
</schema>"""
    )
    plan, extra, caps = s.children
    assert (plan.name, plan.cache, plan.src, plan.line) == ("plan", True, None, 2)
    assert isinstance(plan.children[1], Module)
    detail = plan.children[1]
    assert (detail.name, detail.cache, detail.line) == ("detail", False, 3)
    assert extra.cache is True and caps.cache is False
    assert [m.name for m in s.submodules()] == ["plan", "extra", "caps"]
    assert [m.name for m in plan.submodules()] == ["detail"]


def test_module_src_is_read_relative_to_the_schema_file(tmp_path):
    (tmp_path / "code").mkdir()
    (tmp_path / "code" / "a.py").write_text("def f():\n    return 1\n")
    path = tmp_path / "s.xml"
    path.write_text('<schema name="s">\n<module name="a" src="code/a.py"/>\n</schema>')
    s = parse_schema(path)
    (a,) = s.children
    assert a.src == "code/a.py"
    assert texts(a.children) == ["def f():\n    return 1"]
    assert s.source == str(path)
    # the digest covers the src file's content
    (tmp_path / "code" / "a.py").write_text("def f():\n    return 2\n")
    assert parse_schema(path).digest != s.digest


def test_union_members_and_scaffold():
    s = parse_schema(
        """<schema name="s">
  <union scaffold="paris">
    <module name="paris">Paris.</module>
    <module name="tokyo">Tokyo.</module>
  </union>
  <union>
    <module name="a">A.</module>
  </union>
</schema>"""
    )
    u0, u1 = s.children
    assert isinstance(u0, Union) and isinstance(u1, Union)
    assert [m.name for m in u0.members] == ["paris", "tokyo"]
    assert (u0.scaffold, u0.index, u0.line) == ("paris", 0, 2)
    assert (u1.scaffold, u1.index) == (None, 1)
    assert [m.name for m in s.submodules()] == ["paris", "tokyo", "a"]


def test_parameter_attributes():
    s = parse_schema(
        '<schema name="s"><module name="m">Trip of <parameter name="days" length="4"/> days'
        ' to <parameter name="city" length=" 6 " scaffold="some city"/>.</module></schema>'
    )
    (m,) = s.children
    days, city = [c for c in m.children if isinstance(c, Parameter)]
    assert (days.name, days.length, days.scaffold) == ("days", 4, "")
    assert (city.name, city.length, city.scaffold) == ("city", 6, "some city")


def test_roles_wrap_modules_unions_and_parameters():
    s = parse_schema(
        """<schema name="s">
  <system>You plan trips.</system>
  <user>
    <module name="plan">Plan <parameter name="days" length="2"/> days.</module>
    <union scaffold="a"><module name="a">A</module><module name="b">B</module></union>
    Anonymous text.
  </user>
  <assistant>Sure.</assistant>
</schema>"""
    )
    assert s.roles == ("system", "user", "assistant")
    system, user, assistant = s.children
    assert isinstance(system, Role) and system.line == 2
    assert texts(system.children) == ["You plan trips."]
    plan, union, anon = user.children
    assert isinstance(plan, Module) and isinstance(union, Union)
    assert any(isinstance(c, Parameter) for c in plan.children)
    assert anon.text == " Anonymous text."
    assert [m.name for m in s.submodules()] == ["plan", "a", "b"]


def test_comments_and_processing_instructions_are_dropped_and_text_joined():
    s = parse_schema('<schema name="s">Hello <!-- a comment --> world<?pi x?>!</schema>')
    assert texts(s.children) == ["Hello  world!"]


def test_character_references_and_cdata_are_text():
    s = parse_schema('<schema name="s">a &lt;b&gt; &amp; <![CDATA[<raw>]]></schema>')
    assert texts(s.children) == ["a <b> & <raw>"]


def test_byte_order_mark_is_allowed(tmp_path):
    assert parse_schema('\ufeff<schema name="s">x</schema>').name == "s"
    assert parse_prompt('\ufeff<prompt schema="s"/>').schema == "s"
    (tmp_path / "s.xml").write_bytes('\ufeff<schema name="s">\n<module name="a">x</module></schema>'.encode())
    assert parse_schema(tmp_path / "s.xml").children[0].line == 2


def test_xml_declaration_does_not_change_the_text():
    s = parse_schema('<?xml version="1.0" encoding="latin-1"?>\n<schema name="s">café</schema>')
    assert texts(s.children) == ["café"]
    assert s.line == 2


# ---------------------------------------------------------------------------------------------
# Prompts


def test_prompt_refs_with_arguments_and_nesting():
    p = parse_prompt('<prompt schema="travel"><plan days="3"><detail/></plan><tokyo/></prompt>')
    assert p.schema == "travel"
    plan, tokyo = p.children
    assert plan == ModuleRef("plan", {"days": "3"}, [ModuleRef("detail", {}, [], 1)], 1)
    assert tokyo == ModuleRef("tokyo", {}, [], 1)


def test_prompt_free_text_between_refs_and_roles():
    p = parse_prompt(
        """<prompt schema="travel">
  <plan days="3"/>
  Then
  <tokyo/>
  <user>Highlight <budget/> the food.</user>
  <assistant>Sure</assistant>
</prompt>"""
    )
    plan, then, tokyo, user, assistant = p.children
    assert isinstance(plan, ModuleRef) and plan.line == 2
    assert then == Text(" Then", 3)
    assert tokyo.name == "tokyo" and tokyo.line == 4
    assert isinstance(user, PromptRole) and (user.role, user.line) == ("user", 5)
    assert [type(c).__name__ for c in user.children] == ["Text", "ModuleRef", "Text"]
    assert texts(user.children) == ["Highlight", " the food."]
    assert (assistant.role, texts(assistant.children)) == ("assistant", ["Sure"])


def test_prompt_without_schema_is_plain_text():
    p = parse_prompt("  What is   the capital of France?  ")
    assert p == Prompt(schema=None, children=[Text("What is   the capital of France?", 1)])
    p = parse_prompt("<prompt>Just <user>text</user></prompt>")
    assert p.schema is None
    assert texts(p.children) == ["Just"]
    assert isinstance(p.children[1], PromptRole)


def test_long_plain_prompt_is_text_not_a_path():
    long = "why " * 200  # longer than any file name
    assert parse_prompt(long).children == [Text(long.strip(), 1)]


def test_prompt_from_file(tmp_path):
    path = tmp_path / "p.xml"
    path.write_text('<prompt schema="s">\n  <a/>\n</prompt>\n')
    p = parse_prompt(path)
    assert (p.source, p.schema, p.children) == (str(path), "s", [ModuleRef("a", {}, [], 2)])
    assert parse_prompt(path.read_text()).children == p.children  # the same text given as a str


# ---------------------------------------------------------------------------------------------
# The whitespace rule (parser.py docstring)


@pytest.mark.parametrize(
    "body, expected",
    [
        # inside a run text is verbatim; the edges of runs are stripped; no separator at the start
        ("\n  Hello   world\n    again  \n", ["Hello   world\n  again"]),  # common indentation goes
        ("\n    def f():\n        return 1\n  ", ["def f():\n    return 1"]),
        ("A\n  def f():\n      return 1", ["A\n  def f():\n      return 1"]),  # starts inline: as written
        # whitespace at the end of the first span or the start of the second: exactly one space
        ('A   <module name="m">B</module>', ["A", " B"]),
        ('A<module name="m">   B</module>', ["A", " B"]),
        ('A\n\n<module name="m">\n\nB</module>', ["A", " B"]),
        # no whitespace, no separator
        ('A<module name="m">B</module>C', ["A", "B", "C"]),
        # a whitespace-only run between two spans, across tags
        ('A<module name="m">\n  <module name="n">B</module></module>', ["A", " B"]),
        ('A<module name="m">B</module>\n<module name="n">C</module>', ["A", "B", " C"]),
        # a whitespace-only module is dropped, its whitespace still separates
        ('A<module name="m">  </module>B', ["A", " B"]),
        # after a module ending in whitespace
        ('<module name="m">A </module>B', ["A", " B"]),
        # whitespace inside a union, around its members, counts too
        ('Go to<union> <module name="a">Paris</module><module name="b">Rome</module></union>',
         ["Go to", " Paris", "Rome"]),
        ('Go to <union><module name="a">Paris</module><module name="b">Rome</module></union>',
         ["Go to", " Paris", " Rome"]),
        ('<union><module name="a">A</module></union>then', ["A", "then"]),
        ('<union><module name="a">A</module>\n</union>then', ["A", " then"]),
        ('<union><module name="a">A </module><module name="b">B</module></union>then',
         ["A", "B", " then"]),
    ],
)
def test_whitespace_rule_in_schemas(body, expected):
    s = parse_schema(f'<schema name="s">{body}</schema>')
    assert texts(_leaves(s.children)) == expected


def _leaves(children):
    for c in children:
        if isinstance(c, (Text, Parameter)):
            yield c
        elif isinstance(c, (Module, Role, ModuleRef, PromptRole)):
            yield from _leaves(c.children)
        elif isinstance(c, Union):
            for m in c.members:
                yield from _leaves(m.children)


@pytest.mark.parametrize(
    "body, lead, after",
    [
        ('of <parameter name="p" length="2"/> days', True, " days"),
        ('of<parameter name="p" length="2"/>days', False, "days"),
        ('of\n<parameter name="p" length="2"/>\ndays', True, " days"),
        ('<parameter name="p" length="2"/> days', False, " days"),  # at the schema start
    ],
)
def test_whitespace_rule_for_parameters(body, lead, after):
    s = parse_schema(f'<schema name="s"><module name="m">{body}</module></schema>')
    (m,) = s.children
    (p,) = [c for c in m.children if isinstance(c, Parameter)]
    assert p.lead_space is lead
    assert texts(m.children)[-1] == after


def test_whitespace_rule_at_role_starts():
    s = parse_schema(
        '<schema name="s"><system>\n  Be brief.\n</system>\n<user> <module name="q">\n Q</module> more</user></schema>'
    )
    system, user = s.children
    assert texts(system.children) == ["Be brief."]  # no separator at a role's start
    assert texts(_leaves(user.children)) == ["Q", " more"]


def test_whitespace_rule_in_src_files(tmp_path):
    (tmp_path / "doc.txt").write_text("\n\n  First line.\n  Second line.\n\n")
    (tmp_path / "s.xml").write_text('<schema name="s">Intro:<module name="d" src="doc.txt"/></schema>')
    (intro, d) = parse_schema(tmp_path / "s.xml").children
    assert intro.text == "Intro:"
    assert texts(d.children) == [" First line.\n  Second line."]


def test_whitespace_rule_in_prompts():
    # a prompt with a schema continues the schema: its leading whitespace is a separator
    assert texts(parse_prompt('<prompt schema="s">  Hi  </prompt>').children) == [" Hi"]
    assert texts(parse_prompt('<prompt schema="s">Hi</prompt>').children) == ["Hi"]
    assert texts(parse_prompt('<prompt schema="s"><a/>Hi <b/>  there</prompt>').children) == ["Hi", " there"]
    # no separator at the start of a prompt without schema, or of a role's content
    assert texts(parse_prompt("<prompt>  Hi  </prompt>").children) == ["Hi"]
    (user,) = parse_prompt('<prompt schema="s"><user>\n  Hi\n</user></prompt>').children
    assert texts(user.children) == ["Hi"]


def test_src_files_are_verbatim(tmp_path):
    (tmp_path / "code.py").write_text("def f():\n    return 1\n")
    (tmp_path / "s.xml").write_text('<schema name="s"><module name="m" src="code.py"/></schema>')
    schema = parse_schema(tmp_path / "s.xml")
    assert texts(_leaves(schema.children)) == ["def f():\n    return 1"]
