"""The Python -> PML builder (promptcache/builder.py): what it writes lays out exactly like the
equivalent hand-written PML; pretty output parses like the exact output; escaping survives a
round trip; save() is atomic; every mistake is a PMLError naming it.

Language layer only: no torch.
"""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
import textwrap
from dataclasses import fields, is_dataclass, replace
from pathlib import Path
from xml.sax.saxutils import escape, quoteattr

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from promptcache import PMLError, layout_prompt, layout_schema, parse_prompt, parse_schema
from promptcache.builder import (
    Module,
    Param,
    Prompt,
    Ref,
    Role,
    Schema,
    Union,
    assistant,
    module,
    param,
    ref,
    system,
    union,
    user,
)
from promptcache.pml.nodes import Text
from promptcache.pml.rules import MAX_PARAMETER_LENGTH
from promptcache.tokens import WordTokenizer

REPO = Path(__file__).resolve().parents[2]


def shape(node):
    """A parsed tree without line numbers (which differ between pretty and exact output)."""
    if isinstance(node, list):
        return [shape(c) for c in node]
    if is_dataclass(node):
        return (type(node).__name__,) + tuple(shape(getattr(node, f.name)) for f in fields(node) if f.name != "line")
    return node


def schema_view(layout):
    """Everything a schema layout says about positions and content, without source lines."""
    return (
        layout.name,
        layout.spans,
        layout.end,
        layout.glue,
        {p: (m.start, m.end, m.cache, m.union, tuple(m.params)) for p, m in layout.modules.items()},
        {i: (u.start, u.length, u.scaffold, u.members, u.parent) for i, u in layout.unions.items()},
    )


def prompt_view(layout):
    return layout.spans, layout.imports


# ---------------------------------------------------------------------------------------------
# Round trips: builder -> PML -> parse -> layout equals the hand-written schema's layout


HAND_SCHEMA = """<schema name="travel">
  <system>You are a travel planner.</system>
  <user>
    <module name="plan">Plan a trip of <parameter name="days" length="4" scaffold="five"/> days.
      <module name="detail">Give opening hours.</module>
    </module>
    <union scaffold="paris">
      <module name="paris">Paris is big.</module>
      <module name="tokyo">Tokyo is bigger.</module>
    </union>
    <union>
      <module name="train">Go by <parameter name="line" length="3"/> train.</module>
      <module name="plane" cache="false">Fly.</module>
    </union>
    <module name="budget" cache="false">Keep it cheap.</module>
    <module name="code" src="files/main.py"/>
  </user>
  <assistant>Sure.</assistant>
</schema>
"""

HAND_PROMPT = """<prompt schema="travel">
  <plan days="3"><detail/></plan>
  <tokyo/>
  Highlight the food.
  <user>Any <budget/> tips, <plane/> for <code/> me?</user>
</prompt>
"""


def travel_schema() -> Schema:
    # Separators sit elsewhere than in HAND_SCHEMA (after `plan` instead of inside it, between
    # a union and its neighbours instead of inside it): the whitespace rule makes them the same.
    return Schema(
        "travel",
        system("You are a travel planner."),
        user(
            module(
                "plan", "Plan a trip of ", param("days", length=4, scaffold="five"), " days. ",
                module("detail", "Give opening hours."),
            ),
            union(module("paris", "Paris is big."), module("tokyo", "Tokyo is bigger."), scaffold="paris"),
            union(module("train", "Go by ", param("line", 3), " train."), module("plane", "Fly.", cache=False)),
            module("budget", "Keep it cheap.", cache=False),
            module("code", src=Path("files/main.py")),
            sep="\n",
        ),
        assistant("Sure."),
    )


def travel_prompt(schema) -> Prompt:
    return Prompt(
        schema,
        ref("plan", ref("detail"), days="3"),
        ref("tokyo"),
        "Highlight the food.",
        user("Any ", ref("budget"), " tips, ", ref("plane"), " for ", ref("code"), " me?"),
        sep=" ",
    )


@pytest.mark.parametrize("pretty", [True, False])
def test_schema_and_prompt_with_every_feature_lay_out_like_hand_written_pml(tmp_path, pretty):
    (tmp_path / "files").mkdir()
    (tmp_path / "files" / "main.py").write_text("def f():\n    return 1\n")
    (tmp_path / "hand.xml").write_text(HAND_SCHEMA)
    s = travel_schema()
    built = tmp_path / "built.xml"
    if pretty:
        assert s.save(built) == built
    else:
        built.write_text(s.to_pml(pretty=False))
    tok = WordTokenizer()
    hand_layout, built_layout = layout_schema(tmp_path / "hand.xml", tok), layout_schema(built, tok)
    assert schema_view(built_layout) == schema_view(hand_layout)
    assert shape(parse_schema(built).children) == shape(parse_schema(tmp_path / "hand.xml").children)
    # the src file was read relative to the saved schema
    assert any(s.module == ("code",) for s in built_layout.spans)

    for schema_arg in (s, "travel"):  # checked against the builder schema, or by name only
        p = travel_prompt(schema_arg)
        expected = layout_prompt(HAND_PROMPT, hand_layout, tok)
        assert prompt_view(layout_prompt(p.to_pml(pretty=pretty), built_layout, tok)) == prompt_view(expected)


def test_schema_without_roles_anonymous_text_nested_modules_and_unions():
    hand = (
        '<schema name="doc">Intro text. <module name="a">A <module name="b">B <parameter name="x" length="2"'
        ' scaffold="y"/></module> tail</module><union><module name="c">C</module><module name="d">'
        "D <union scaffold=\"f\"><module name=\"e\">E</module><module name=\"f\">F</module></union></module>"
        "</union> End.</schema>"
    )
    s = Schema(
        "doc",
        "Intro text. ",
        module("a", "A ", module("b", "B ", param("x", 2, "y")), " tail"),
        union(module("c", "C"), module("d", "D ", union(module("e", "E"), module("f", "F"), scaffold="f"))),
        " End.",
    )
    assert s.to_pml(pretty=False) == hand
    tok = WordTokenizer()
    for pretty in (True, False):
        assert schema_view(layout_schema(s.to_pml(pretty=pretty), tok)) == schema_view(layout_schema(hand, tok))
    p = Prompt(s, "Before ", ref("a", ref("b", x="two words")), " between ", ref("d", ref("e")), " after")
    hand_p = '<prompt schema="doc">Before <a><b x="two words"/></a> between <d><e/></d> after</prompt>'
    assert p.to_pml(pretty=False) == hand_p
    sl = layout_schema(hand, tok)
    assert prompt_view(layout_prompt(p.to_pml(), sl, tok)) == prompt_view(layout_prompt(hand_p, sl, tok))


def test_plain_prompts_and_prompt_roles():
    tok = WordTokenizer()
    for p, hand in [
        (Prompt(None, "What is ", "the capital?"), "What is the capital?"),
        (Prompt(None, "Hi", user("Tell me."), assistant("Sure")),
         "<prompt>Hi<user>Tell me.</user><assistant>Sure</assistant></prompt>"),
    ]:
        assert prompt_view(layout_prompt(str(p), None, tok)) == prompt_view(layout_prompt(hand, None, tok))
    s = Schema("chat", system("Be brief."), user(module("q", "Question:")))
    hand_s = '<schema name="chat"><system>Be brief.</system><user><module name="q">Question:</module></user></schema>'
    p = Prompt(s, ref("q"), user(" Why?"), assistant("Because"))  # user continues the schema's user message
    hand_p = '<prompt schema="chat"><q/><user> Why?</user><assistant>Because</assistant></prompt>'
    sl = layout_schema(hand_s, tok)
    assert schema_view(layout_schema(str(s), tok)) == schema_view(sl)
    assert prompt_view(layout_prompt(str(p), sl, tok)) == prompt_view(layout_prompt(hand_p, sl, tok))


@pytest.mark.parametrize(
    "children, hand",
    [
        ((module("plan", "Plan a trip of ", param("days", length=4), " days."),),
         '<module name="plan">Plan a trip of <parameter name="days" length="4"/> days.</module>'),
        ((module("plan", "of", param("days", length=4), "days"),),
         '<module name="plan">of<parameter name="days" length="4"/>days</module>'),
        (("A   ", module("m", "B")), 'A   <module name="m">B</module>'),
        (("A", module("m", "B"), "C"), 'A<module name="m">B</module>C'),
        (("A", module("m", "\n  ", module("n", "B"))), 'A<module name="m">\n  <module name="n">B</module></module>'),
        (("A", module("m", "  "), "B"), 'A<module name="m">  </module>B'),
        ((module("m", "A "), "B"), '<module name="m">A </module>B'),
        (("Go to", union(module("a", " Paris"), module("b", "Rome"))),
         'Go to<union> <module name="a">Paris</module><module name="b">Rome</module></union>'),
        (("Go to ", union(module("a", "Paris"), module("b", "Rome"))),
         'Go to <union><module name="a">Paris</module><module name="b">Rome</module></union>'),
        ((union(module("a", "A")), "then"), '<union><module name="a">A</module></union>then'),
        ((union(module("a", "A ")), "then"), '<union><module name="a">A</module>\n</union>then'),
        ((union(module("a", "A "), module("b", "B")), "then"),
         '<union><module name="a">A </module><module name="b">B</module></union>then'),
    ],
)
def test_whitespace_is_exactly_what_the_caller_wrote(children, hand):
    s = Schema("s", *children)
    hand = f'<schema name="s">{hand}</schema>'
    tok = WordTokenizer()
    for pretty in (True, False):
        assert shape(parse_schema(s.to_pml(pretty=pretty)).children) == shape(parse_schema(hand).children)
        assert schema_view(layout_schema(s.to_pml(pretty=pretty), tok)) == schema_view(layout_schema(hand, tok))


def test_exact_output_and_sep():
    s = Schema("s", module("plan", "Plan a trip of ", param("days", length=4), " days."))
    assert s.to_pml(pretty=False) == (
        '<schema name="s"><module name="plan">Plan a trip of <parameter name="days" length="4"/> days.</module></schema>'
    )
    assert str(s) == s.to_pml() and s.to_pml().endswith("\n")
    # sep goes between consecutive children, nothing is added otherwise
    s = Schema("s", module("a", "A"), module("b", "B"), module("c", "x", "y", sep="-"), sep=" ")
    assert s.to_pml(pretty=False) == (
        '<schema name="s"><module name="a">A</module> <module name="b">B</module> <module name="c">x-y</module></schema>'
    )
    assert user("a", "b", sep=", ") == Role("user", [Text("a", None), Text(", ", None), Text("b", None)], None)
    assert module("m", "only", sep=" ").children == [Text("only", None)]


def test_pretty_output_puts_blocks_on_their_own_lines_where_whitespace_allows():
    s = Schema("s", system("Hi."), user(module("a", "A"), union(module("b", "B"), module("c", "C")), sep="\n"))
    assert s.to_pml() == textwrap.dedent(
        """\
        <schema name="s">
          <system>Hi.</system>
          <user>
            <module name="a">A</module>
            <union>
              <module name="b">B</module>
              <module name="c">C</module>
            </union>
          </user>
        </schema>
        """
    )
    # no whitespace was written between the modules: none is added (it would be a separator)
    s = Schema("s", module("a", "A"), union(module("b", "B")), "C")
    assert s.to_pml() == (
        '<schema name="s">\n  <module name="a">A</module><union><module name="b">B</module></union>C\n</schema>\n'
    )
    # a prompt with a schema continues it: no newline at its start
    p = Prompt("s", ref("a"), "Then", user("Q"))
    assert p.to_pml() == '<prompt schema="s"><a/>Then\n  <user>Q</user>\n</prompt>\n'


@pytest.mark.parametrize(
    "doc",
    [
        # whitespace at a start stays pending in the parser; a union with an empty member would
        # turn it into a separator before `q`
        Schema("s", union(module("a"), module("b", param("p", 1))), module("c", param("q", 1))),
        Schema("s", user(union(module("a"), module("b", "B")), "C"), system("x")),
        Schema("s", module("m", union(module("a"), module("b", "B")), "C")),
        # after a role, text is separated by whitespace: none may be added there
        Prompt("s", system("x"), "Then"),
        Prompt(None, user("x"), "Then", assistant("y")),
        Prompt("s", ref("a"), user("Q"), ref("b")),
        # a run's first line moved onto its own line would change the indentation removed
        Schema("s", "a \n    x", module("m")),
        Schema("s", module("m", "A"), " B\n      C\n      D", module("n")),
        Schema("s", system("Q"), user("def f():\n    return 1", module("m"))),
    ],
    ids=repr,
)
def test_pretty_printing_leaves_the_meaning_alone(doc):
    parse = parse_schema if isinstance(doc, Schema) else parse_prompt
    expected = shape(parse(reference(doc)).children)
    assert shape(parse(doc.to_pml(pretty=False)).children) == expected
    assert shape(parse(doc.to_pml(pretty=True)).children) == expected


def test_text_runs_follow_the_indentation_rule_like_hand_written_pml(tmp_path):
    code = "def f():\n    return 1"
    s = Schema("s", module("inline", code), module("flush", "\n" + code), module("file", src="f.py"))
    (tmp_path / "f.py").write_text(code)
    hand = (
        f'<schema name="s"><module name="inline">{code}</module><module name="flush">\n{code}</module>'
        '<module name="file" src="f.py"/></schema>'
    )
    (tmp_path / "hand.xml").write_text(hand)
    texts = [m.children[0].text for m in parse_schema(s.save(tmp_path / "s.xml")).children]
    assert texts == [m.children[0].text for m in parse_schema(tmp_path / "hand.xml").children]
    # the parser's rule: a run starting right after its tag is kept as written; one starting on a
    # new line loses its common indentation (here none: column 0), the newline being a separator;
    # src files are verbatim
    assert texts == [code, " " + code, code]


# ---------------------------------------------------------------------------------------------
# Escaping

NASTY = "a < b && c > d ]]> \"double\" 'single' café Ω 🙂 \\ &amp; &lt; <!-- x --> <![CDATA[y]]>"


def test_text_is_escaped_and_round_trips():
    s = Schema("s", module("m", NASTY, " line1\n  line2\r\nend\ttab"))
    (m,) = parse_schema(s.to_pml()).children
    assert [c.text for c in m.children] == [NASTY + " line1\n  line2\r\nend\ttab"]
    p = parse_prompt(str(Prompt(None, NASTY)))
    assert p.children[0].text == NASTY


@pytest.mark.parametrize("value", [NASTY, "two\nlines\tand\r\ncr", " padded ", "", '"', "'", "&#10;"])
def test_attributes_are_escaped_and_round_trip(tmp_path, value):
    scaffold = value or "x"
    s = Schema("s", module("m", "Go ", param("p", MAX_PARAMETER_LENGTH, scaffold)))
    (m,) = parse_schema(s.to_pml()).children
    assert m.children[1].scaffold == scaffold
    (r,) = parse_prompt(str(Prompt("s", ref("m", p=value)))).children
    assert r.args == {"p": value}
    src = f"dir with 'quotes' & <angles>/{value.strip() or 'f'}.txt".replace("\n", "_").replace("\r", "_")
    path = tmp_path / src
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("from a file")
    (m,) = parse_schema(Schema("s", module("m", src=src)).save(tmp_path / "s.xml")).children
    assert m.src == src and m.children[0].text == "from a file"


# ---------------------------------------------------------------------------------------------
# Random trees: pretty output, exact output and a reference rendering all parse the same

PIECES = st.sampled_from(
    ["a", "bb c.", "x&y", "<i>", "'q'", '"d"', "é", "]]>", "a\nb", "\r", "Ω",
     "\n    x", "\n  y\n      z", "\n\t w", "\n \n"]  # indented lines: the parser removes common indentation
)
SPACE = st.sampled_from(["", "", "", " ", "\n  ", "\t", "\n"])  # mostly none: separators matter


@st.composite
def texts(draw):
    return draw(SPACE) + " ".join(draw(st.lists(PIECES, max_size=3))) + draw(SPACE)


@st.composite
def b_modules(draw, depth, names):
    kids = draw(b_children(depth - 1, names, in_module=True))
    return module(f"m{next(names)}", *kids, cache=draw(st.booleans()), sep=draw(st.sampled_from(["", "", " "])))


@st.composite
def b_unions(draw, depth, names):
    members = draw(st.lists(b_modules(depth, names), min_size=1, max_size=3))
    scaffold = draw(st.sampled_from([None] + [m.name for m in members]))
    return union(*members, scaffold=scaffold)


@st.composite
def b_children(draw, depth, names, in_module):
    kinds = [texts()]
    if in_module:
        kinds.append(st.builds(lambda n, s: param(f"p{next(names)}", n, s), st.integers(1, 5), texts()))
    if depth > 0:
        kinds += [b_modules(depth, names), b_unions(depth, names)]
    return draw(st.lists(st.one_of(kinds), max_size=4))


@st.composite
def b_schemas(draw):
    names = itertools.count()
    sep = draw(st.sampled_from(["", " ", "\n"]))
    if draw(st.booleans()):
        roles = draw(st.lists(st.sampled_from([system, user, assistant]), min_size=1, max_size=3))
        gaps = draw(st.lists(SPACE, min_size=len(roles), max_size=len(roles)))
        kids = []
        for role, gap in zip(roles, gaps):
            kids += [gap, role(*draw(b_children(2, names, in_module=False)), sep=sep)]
        return Schema("s", *kids)
    kids = draw(b_children(2, names, in_module=False))
    if not any(not isinstance(c, str) or c.strip() for c in kids):
        with pytest.raises(PMLError, match="schema 's' is empty"):
            Schema("s", *kids, sep=sep)
        text = f'<schema name="s">{escape(sep.join(kids))}</schema>'
        with pytest.raises(PMLError, match="schema 's' is empty"):
            parse_schema(text)
        return None
    return Schema("s", *kids, sep=sep)


ARGS = st.sampled_from(["3", "", "a b", 'x"y', "<&>", "l1\nl2", "\t", " lead"])


@st.composite
def b_refs(draw, depth, names):
    kids = draw(st.lists(b_refs(depth - 1, names), max_size=2)) if depth > 0 else []
    args = {f"a{i}": draw(ARGS) for i in range(draw(st.integers(0, 2)))}
    return ref(f"r{next(names)}", *kids, **args)


@st.composite
def b_prompts(draw):
    names = itertools.count()
    has_schema = draw(st.booleans())
    inline = [texts()] + ([b_refs(2, names)] if has_schema else [])
    roles = st.builds(
        lambda r, kids: r(*kids), st.sampled_from([system, user, assistant]), st.lists(st.one_of(inline), max_size=3)
    )
    kids = draw(st.lists(st.one_of(inline + [roles, roles]), max_size=6))
    return Prompt("s" if has_schema else None, *kids, sep=draw(st.sampled_from(["", " ", "\n"])))


def _indent_kept(run: str) -> str:
    """The builder's writing rule: an indented first line of a multi-line run gets a newline
    before it, so the parser dedents all lines alike."""
    first = run.split("\n")[0]
    return "\n" + run if "\n" in run and first[:1] in (" ", "\t") and first.strip() else run


def _join_runs(children) -> list:
    out = []
    for c in children:
        if isinstance(c, Text) and out and isinstance(out[-1], str):
            out[-1] += c.text
        else:
            out.append(c.text if isinstance(c, Text) else c)
    return [_indent_kept(c) if isinstance(c, str) else c for c in out]


def reference(node) -> str:
    """Hand-written-style PML for a builder node, independent of lxml."""
    if isinstance(node, str):
        return escape(node, {"\r": "&#13;"})
    if isinstance(node, (Schema, Prompt, Module, Role, Ref)):
        body = "".join(map(reference, _join_runs(node.children)))
    if isinstance(node, Schema):
        return f'<schema name="{node.name}">{body}</schema>'
    if isinstance(node, Prompt):
        attr = "" if node.schema is None else f' schema="{node.schema}"'
        return f'<prompt{attr}>{body}</prompt>'
    if isinstance(node, Param):
        scaffold = f" scaffold={quoteattr(node.scaffold)}" if node.scaffold else ""
        return f'<parameter name="{node.name}" length="{node.length}"{scaffold}/>'
    if isinstance(node, Module):
        cache = "" if node.cache else ' cache="false"'
        return f'<module name="{node.name}"{cache}>{body}</module>'
    if isinstance(node, Union):
        scaffold = "" if node.scaffold is None else f' scaffold="{node.scaffold}"'
        return f"<union{scaffold}>{''.join(map(reference, node.members))}</union>"
    if isinstance(node, Role):
        return f"<{node.role}>{body}</{node.role}>"
    args = "".join(f" {k}={quoteattr(v)}" for k, v in node.args.items())
    return f"<{node.name}{args}>{body}</{node.name}>"


SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@SETTINGS
@given(b_schemas())
def test_random_schemas_pretty_exact_and_hand_written_parse_alike(s):
    if s is None:  # the builder refused an empty schema: the parser refuses its text alike
        return
    expected = shape(parse_schema(reference(s)).children)
    assert shape(parse_schema(s.to_pml(pretty=False)).children) == expected
    assert shape(parse_schema(s.to_pml(pretty=True)).children) == expected
    assert shape(s.tree().children) == expected  # the builder's own tree is the parser's


@SETTINGS
@given(b_prompts())
def test_random_prompts_pretty_exact_and_hand_written_parse_alike(p):
    expected = shape(parse_prompt(reference(p)))
    assert shape(parse_prompt(p.to_pml(pretty=False))) == expected
    assert shape(parse_prompt(p.to_pml(pretty=True))) == expected
    assert shape(replace(p.tree(), source="<string>", line=1)) == expected  # the builder's own tree


# ---------------------------------------------------------------------------------------------
# save()


def test_save_is_atomic_and_creates_folders(tmp_path):
    s = Schema("s", module("a", "A"))
    path = tmp_path / "deep" / "er" / "s.xml"
    assert s.save(path) == path
    assert path.read_text(encoding="utf-8") == s.to_pml()
    assert parse_schema(path).name == "s"
    assert os.listdir(path.parent) == ["s.xml"]  # no temporary file left
    umask = os.umask(0)
    os.umask(umask)
    assert path.stat().st_mode & 0o777 == 0o666 & ~umask  # not the 0600 of a temporary file
    # overwrites in place; a prompt saves the same way (str paths too)
    Prompt("s", ref("a")).save(str(path))
    assert parse_prompt(path).schema == "s"


def test_failed_save_leaves_the_old_file_and_no_temporary(tmp_path, monkeypatch):
    path = tmp_path / "s.xml"
    path.write_text("old")

    def boom(*a):
        raise OSError("disk on fire")

    monkeypatch.setattr(os, "replace", boom)
    with pytest.raises(OSError, match="disk on fire"):
        Schema("s", "new").save(path)
    assert path.read_text() == "old"
    assert os.listdir(tmp_path) == ["s.xml"]


# ---------------------------------------------------------------------------------------------
# Validation: every mistake raises at once, saying what is wrong

TRAVEL = Schema(
    "t",
    module("plan", "Plan ", param("days", 2), module("detail", "D")),
    union(module("paris", "P"), module("tokyo", "T")),
)


@pytest.mark.parametrize(
    "build, message",
    [
        # names
        (lambda: module("1x"), "module name '1x' is not a valid XML name"),
        (lambda: module("a b"), "module name 'a b' is not a valid XML name"),
        (lambda: module(3), "module name must be a string, got int"),
        (lambda: module("schema"), "module name 'schema' is reserved"),
        (lambda: module("user"), "module name 'user' is reserved"),
        (lambda: ref("parameter"), "ref name 'parameter' is reserved"),
        (lambda: ref("no way"), "ref name 'no way' is not a valid XML name"),
        (lambda: Schema("bad name"), "schema name 'bad name' is not a valid XML name"),
        (lambda: Prompt("bad/name"), "schema name 'bad/name' is not a valid XML name"),
        (lambda: param("1d", 4), "parameter name '1d' is not a valid XML name"),
        (lambda: ref("a", **{"bad key": "1"}), "ref('a') argument name 'bad key' is not a valid XML name"),
        # parameters
        (lambda: param("days", 0), "param('days') has length 0: expected a positive int"),
        (lambda: param("days", -1), "has length -1: expected a positive int"),
        (lambda: param("days", 2.0), "has length 2.0: expected a positive int"),
        (lambda: param("days", "4"), "has length '4': expected a positive int"),
        (lambda: param("days", True), "has length True: expected a positive int"),
        (lambda: param("days", MAX_PARAMETER_LENGTH + 1), f"at most {MAX_PARAMETER_LENGTH}"),
        (lambda: param("days", 2, scaffold=3), "scaffold must be a string, got int"),
        (lambda: user(param("p", 1)), "param('p') in user(): a parameter belongs directly in a module"),
        (lambda: Schema("s", param("p", 1)), "param('p') in Schema('s'): a parameter belongs"),
        (lambda: Prompt("s", param("p", 1)), "param('p') in Prompt('s')"),
        (lambda: union(param("p", 1)), "param('p') in union()"),
        (lambda: module("m", param("p", 1), param("p", 2)), "duplicate parameter name 'p' in one module"),
        # modules
        (lambda: module("m", "text", src="f.txt"), "module('m') has both src= and content"),
        (lambda: module("m", src=""), "src must be a non-empty path"),
        (lambda: module("m", cache="no"), "cache must be True or False, got 'no'"),
        (lambda: module("m", 3), "unexpected int 3 in module('m') (expected text, param(), module() or union())"),
        (lambda: module("m", None), "unexpected NoneType None in module('m')"),
        (lambda: module("m", module("a"), union(module("a"))), "duplicate module name 'a' in one scope"),
        (lambda: Schema("s", user(module("a")), assistant(module("a"))), "duplicate module name 'a' in one scope"),
        (lambda: Schema("s"), "schema 's' is empty"),
        (lambda: Schema("s", " ", "\n"), "schema 's' is empty"),
        (lambda: module("m", "a\x00b"), "holds U+0000, a character XML cannot hold"),
        (lambda: param("p", 1, "\x01"), "U+0001"),
        (lambda: module("m", sep=3), "sep must be a string"),
        # unions
        (lambda: union(), "<union> has no <module> members"),
        (lambda: union("Paris"), "text 'Paris' in union(): a union holds only modules"),
        (lambda: union(module("a"), " "), "text ' ' in union(): a union holds only modules"),
        (lambda: union(union(module("a"))), "unexpected union() in union() (expected module())"),
        (lambda: union(module("a"), module("a")), "duplicate module name 'a' in one scope"),
        (lambda: union(module("a"), module("b"), scaffold="c"), "union scaffold 'c' is not one of its members (a, b)"),
        # roles
        (lambda: module("m", user("x")), "user() in module('m'): roles go at the top level"),
        (lambda: user(system("x")), "system() in user(): roles go at the top level"),
        (lambda: ref("a", user("x")), "user() in ref('a'): roles go at the top level"),
        (lambda: Schema("s", "text", user("x")), "content outside a role in a schema that uses roles"),
        (lambda: Schema("s", module("m"), user("x")), "content outside a role"),
        (lambda: user(module("a"), ref("b")), "user() mixes schema content"),
        # refs and prompts
        (lambda: module("m", ref("a")), "ref('a') in module('m'): refs import modules in a Prompt"),
        (lambda: Schema("s", ref("a")), "ref('a') in Schema('s')"),
        (lambda: Schema("s", user(ref("a"))), "ref('a') in user() of Schema('s')"),
        (lambda: Prompt("s", module("a")),
         "module('a') in Prompt('s'): modules are declared in a Schema; import one with ref('a')"),
        (lambda: Prompt("s", user(module("a"))), "module('a') in user() of Prompt('s')"),
        (lambda: Prompt("s", union(module("a"))), "union() in Prompt('s')"),
        (lambda: ref("a", days=3), "argument 'days' of ref('a') must be a string, got int 3"),
        (lambda: ref("a", days=None), "argument 'days' of ref('a') must be a string, got NoneType"),
        (lambda: ref("a", days="\x0b"), "U+000B"),
        (lambda: ref("a", "text"), "text 'text' in ref('a'): a ref holds only nested refs"),
        (lambda: ref("a", module("b")), "module('b') in ref('a'): modules are declared in a Schema"),
        (lambda: ref("a", ref("b"), ref("b")), "module 'a/b' imported twice"),
        (lambda: Prompt("s", ref("a"), user(ref("a"))), "module 'a' imported twice"),
        (lambda: Prompt(None, "Hi", ref("a")), "ref('a') in a prompt without a schema"),
        (lambda: Prompt("s", 42), "unexpected int 42 in Prompt('s') (expected text, ref() or a role)"),
        # a prompt checked against its builder schema
        (lambda: Prompt(TRAVEL, ref("rome")),
         "unknown module 'rome' at the top level of schema 't' (known: paris, plan, tokyo)"),
        (lambda: Prompt(TRAVEL, ref("detail")), "unknown module 'detail' at the top level"),
        (lambda: Prompt(TRAVEL, ref("plan", ref("x"), days="1")),
         "unknown module 'x' inside 'plan' of schema 't' (known: detail)"),
        (lambda: Prompt(TRAVEL, ref("plan")), "module 'plan' needs an argument for parameter(s): days"),
        (lambda: Prompt(TRAVEL, ref("plan", days="1", nights="2")),
         "module 'plan' has no parameter 'nights' (parameters: days)"),
        (lambda: Prompt(TRAVEL, ref("paris", days="1")), "module 'paris' has no parameter 'days' (parameters: none)"),
        (lambda: Prompt(TRAVEL, ref("paris"), user(ref("tokyo"))),
         "two members of one union imported: 'paris' and 'tokyo'"),
    ],
)
def test_validation_errors(build, message):
    with pytest.raises(PMLError) as e:
        build()
    assert message in str(e.value)
    assert isinstance(e.value, ValueError)
    assert str(e.value).startswith("<builder>: ")


def test_valid_edge_cases_build():
    assert Prompt(TRAVEL, ref("plan", ref("detail"), days=""), ref("tokyo")).schema == "t"
    assert module("m").children == [] and module("m", "", "").children == [Text("", None), Text("", None)]
    Schema("s", " ", user(module("a")), "\n", assistant(module("b")), " ")  # whitespace outside roles is fine
    Schema("s", module("a"), module("b", module("a")))  # a nested module is another scope
    Prompt("s", ref("plan", days="3"), ref("detail"))  # by name only: not checked against a schema
    assert ref("r", ref("n"), name="x", cache="y").args == {"name": "x", "cache": "y"}


def test_builder_imports_without_torch():
    code = textwrap.dedent(
        """
        import sys
        from promptcache.builder import Schema, Prompt, module, ref
        s = Schema("s", module("m", "hi"))
        Prompt(s, ref("m")).to_pml()
        assert 'torch' not in sys.modules, 'torch was imported'
        """
    )
    r = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr


def test_code_keeps_its_first_line_indentation_relative_to_the_rest():
    code = "    if x:\n        return 1\n    return 2"  # every line indented, the first included
    s = Schema("s", module("code", code))
    for pretty in (True, False):
        (m,) = parse_schema(s.to_pml(pretty=pretty)).children
        assert m.children[0].text == "if x:\n    return 1\nreturn 2"  # common indentation removed, alike
    (m,) = s.tree().children
    assert m.children[0].text == "if x:\n    return 1\nreturn 2"


def test_builder_trees_are_parser_trees_and_lay_out_alike():
    s = Schema("s", "Intro: ", module("plan", "Plan ", param("days", 2), " days."), union(module("a", "A"), module("b", "B")))
    p = Prompt(s, ref("plan", days="3"), ref("b"), " Go.")
    tok = WordTokenizer()
    via_text = layout_prompt(p.to_pml(), layout_schema(s.to_pml(), tok), tok)
    via_tree = layout_prompt(p.tree(), layout_schema(s.tree(), tok), tok)
    assert [(x.token_ids, x.position_ids) for x in via_tree] == [(x.token_ids, x.position_ids) for x in via_text]
    assert s.tree().digest == parse_schema(s.to_pml()).digest
    with pytest.raises(PMLError, match="save"):
        Schema("s", module("code", src="a.py")).tree()
