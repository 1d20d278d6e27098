"""Layout arithmetic, with expected positions computed by hand (docs/pml.md "Positions").

ToyTokenizer: one token per whitespace-separated word (leading whitespace attached), so
"Plan a trip of" is 4 tokens and " days." is 1. PlainRoles glue: "System: " and "User: " are
1 token each ("System:"), "\\nUser: " is 1, "\\nAssistant:" is 1.
"""

import pytest

from pml_tokenizers import ToyTokenizer
from promptcache import PMLError, layout_prompt, layout_schema
from promptcache.layout import SchemaLayout


def spans(layout: SchemaLayout):
    """(name, kind, start, end) of each schema span."""
    return [(s.name, s.kind, s.start, s.end) for s in layout.spans]


def pspans(pl):
    """(name, kind, source, first position, last position + 1) of each prompt span."""
    return [(s.name, s.kind, s.source, s.position_ids[0], s.position_ids[-1] + 1) for s in pl.spans]


SEQ = (
    '<schema name="s">one two <module name="a">three four five</module> six'
    ' <module name="b">seven</module></schema>'
)


def test_sequential_walk():
    lay = layout_schema(SEQ, ToyTokenizer())
    assert spans(lay) == [
        ("(schema)", "text", 0, 2),  # "one two"
        ("a", "text", 2, 5),  # " three four five"
        ("(schema)", "text", 5, 6),  # " six"
        ("b", "text", 6, 7),  # " seven"
    ]
    assert lay.end == 7
    assert (lay.modules[("a",)].start, lay.modules[("a",)].end) == (2, 5)
    assert (lay.modules[("b",)].start, lay.modules[("b",)].end) == (6, 7)


def test_position_ids_are_consecutive_within_a_span():
    tok = ToyTokenizer()
    lay = layout_schema(SEQ, tok)
    pl = layout_prompt('<prompt schema="s"><a/><b/></prompt>', lay, tok)
    assert [s.position_ids for s in pl.spans] == [(0, 1), (2, 3, 4), (5,), (6,)]
    assert pl.position_ids == list(range(7))
    assert tok.decode(pl.token_ids) == "one two three four five six seven"


UNION = """<schema name="s">intro
<union scaffold="x">
  <module name="x">a b</module>
  <module name="y">c d e f</module>
  <module name="z">g</module>
</union>
outro words</schema>"""


def test_union_members_share_a_start_and_the_union_takes_the_longest():
    lay = layout_schema(UNION, ToyTokenizer())
    assert spans(lay) == [
        ("(schema)", "text", 0, 1),
        ("x", "text", 1, 3),
        ("y", "text", 1, 5),
        ("z", "text", 1, 2),
        ("(schema)", "text", 5, 7),  # resumes at 1 + longest (4)
    ]
    u = lay.unions[0]
    assert (u.start, u.length, u.scaffold, u.members) == (1, 4, "x", ("x", "y", "z"))
    assert [s.choices for s in lay.spans] == [(), ((0, "x"),), ((0, "y"),), ((0, "z"),), ()]
    assert lay.modules[("z",)].union == 0 and lay.end == 7


def test_prompt_keeps_the_imported_members_positions():
    tok = ToyTokenizer()
    lay = layout_schema(UNION, tok)
    pl = layout_prompt('<prompt schema="s"><z/></prompt>', lay, tok)
    assert pspans(pl) == [
        ("(schema)", "cached", "schema", 0, 1),
        ("z", "cached", "module", 1, 2),
        ("(schema)", "cached", "schema", 5, 7),
    ]
    assert pl.imports == (("z",),)


NESTED_UNION = """<schema name="s"><module name="m">m1
  <union>
    <module name="p">p1 p2</module>
    <module name="q">q1 <union><module name="r">r1 r2 r3</module><module name="t">t1</module></union></module>
  </union>
  m2</module> end</schema>"""


def test_nested_unions():
    lay = layout_schema(NESTED_UNION, ToyTokenizer())
    # m1 [0,1); union0 at 1: p [1,3), q: q1 [1,2) + union1 at 2: r [2,5), t [2,3) -> q is 4 long
    assert spans(lay) == [
        ("m", "text", 0, 1),
        ("m/p", "text", 1, 3),
        ("m/q", "text", 1, 2),
        ("m/q/r", "text", 2, 5),
        ("m/q/t", "text", 2, 3),
        ("m", "text", 5, 6),
        ("(schema)", "text", 6, 7),
    ]
    assert (lay.unions[0].start, lay.unions[0].length) == (1, 4)
    assert (lay.unions[1].start, lay.unions[1].length) == (2, 3)
    assert lay.spans[3].choices == ((0, "q"), (1, "r"))
    assert (lay.modules[("m", "q")].start, lay.modules[("m", "q")].end) == (1, 5)


PARAM = (
    '<schema name="s"><module name="m">Plan a trip of <parameter name="days" length="3"/> days'
    ' to <parameter name="city" length="2" scaffold="somewhere"/>.</module> end</schema>'
)


def test_parameters_reserve_length_positions():
    tok = ToyTokenizer()
    lay = layout_schema(PARAM, tok)
    assert spans(lay) == [
        ("m", "text", 0, 4),  # "Plan a trip of"
        ("m.days", "param", 4, 7),
        ("m", "text", 7, 9),  # " days to"
        ("m.city", "param", 9, 11),
        ("m", "text", 11, 12),  # "."
        ("(schema)", "text", 12, 13),  # " end"
    ]
    days, city = lay.spans[1], lay.spans[3]
    assert days.token_ids == (0, 0, 0)  # no scaffold: all padding
    assert tok.decode(city.token_ids[:1]) == " somewhere" and city.token_ids[1:] == (0,)
    assert not days.stored and lay.spans[0].stored
    assert set(lay.modules[("m",)].params) == {"days", "city"}


def test_argument_takes_the_first_positions_of_its_slot():
    tok = ToyTokenizer()
    lay = layout_schema(PARAM, tok)
    pl = layout_prompt('<prompt schema="s"><m days="five or six" city="Rome"/></prompt>', lay, tok)
    assert pspans(pl) == [
        ("m", "cached", "module", 0, 4),
        ("m.days", "new", "argument", 4, 7),
        ("m", "cached", "module", 7, 9),
        ("m.city", "new", "argument", 9, 10),  # one token of a 2-token slot: position 10 unused
        ("m", "cached", "module", 11, 12),
        ("(schema)", "cached", "schema", 12, 13),
    ]
    assert tok.decode(pl.token_ids) == "Plan a trip of five or six days to Rome. end"


def test_empty_argument_adds_no_tokens():
    tok = ToyTokenizer()
    pl = layout_prompt('<prompt schema="s"><m days="" city="x"/></prompt>', layout_schema(PARAM, tok), tok)
    assert [s.name for s in pl.spans].count("m.days") == 0


FREE = (
    '<schema name="s"><module name="a">a1 a2</module><module name="b">b1 b2 b3</module>'
    '<module name="c">c1</module></schema>'
)  # a [0,2), b [2,5), c [5,6), end 6


def test_free_text_placement():
    tok = ToyTokenizer()
    lay = layout_schema(FREE, tok)
    pl = layout_prompt('<prompt schema="s">pre text <a/> mid one two <c/> after</prompt>', lay, tok)
    assert pspans(pl) == [
        ("(text)", "new", "text", 0, 2),  # before the first import: after what precedes a (nothing)
        ("a", "cached", "module", 0, 2),
        ("(text)", "new", "text", 2, 5),  # between a and c: starts at a's end
        ("c", "cached", "module", 5, 6),
        ("(text)", "new", "text", 6, 7),  # after the last import: right after c, not the schema end
    ]
    assert tok.decode(pl.new[0].token_ids) == "pre text"
    assert tok.decode(pl.new[1].token_ids) == " mid one two"


def test_trailing_text_follows_the_last_included_span_and_a_prompt_without_imports():
    tok = ToyTokenizer()
    lay = layout_schema(SEQ, tok)  # end 7
    pl = layout_prompt('<prompt schema="s"><b/> and more</prompt>', lay, tok)
    assert pspans(pl)[-1] == ("(text)", "new", "text", 7, 9)
    pl = layout_prompt('<prompt schema="s"><a/> and more</prompt>', lay, tok)
    assert pspans(pl)[-1] == ("(text)", "new", "text", 6, 8)  # after " six", not after the schema end (7)
    pl = layout_prompt('<prompt schema="s">only text here</prompt>', lay, tok)
    assert pspans(pl) == [
        ("(schema)", "cached", "schema", 0, 2),
        ("(schema)", "cached", "schema", 5, 6),  # anonymous text is in every prompt
        ("(text)", "new", "text", 6, 9),  # right after the last cached span before it
    ]


EIGHT = '<schema name="s">Notes:' + "".join(f' <module name="n{i}">note {i} code {i}{i}</module>' for i in range(8)) + "</schema>"


@pytest.mark.parametrize("k", [1, 4, 8])
def test_a_prefix_of_imports_and_a_question_has_contiguous_positions(k):
    tok = ToyTokenizer(bos=True)
    lay = layout_schema(EIGHT, tok)
    refs = "".join(f"<n{i}/>" for i in range(k))
    pl = layout_prompt(f'<prompt schema="s">{refs} What is the code for note 2?</prompt>', lay, tok)
    assert pl.position_ids == list(range(len(pl.position_ids)))  # a plain prefill's positions
    assert [s.kind for s in pl.spans][-1] == "new" and all(s.kind == "cached" for s in pl.spans[:-1])


def test_gaps_between_imports_stay():
    tok = ToyTokenizer()
    lay = layout_schema(EIGHT, tok)  # "Notes:" [0,1), n_i [1 + 4i, 5 + 4i)
    pl = layout_prompt('<prompt schema="s"><n1/><n5/> Which?</prompt>', lay, tok)
    assert pspans(pl) == [
        ("(schema)", "cached", "schema", 0, 1),
        ("n1", "cached", "module", 5, 9),
        ("n5", "cached", "module", 21, 25),
        ("(text)", "new", "text", 25, 26),
    ]


def test_consecutive_new_spans_continue():
    tok = ToyTokenizer()
    lay = layout_schema(FREE, tok)
    pl = layout_prompt('<prompt schema="s"><a/> one <user>two three</user> <c/> x</prompt>', lay, tok)
    # the schema has no roles, so <user> opens a message: glue "User: " (1 token), then the final
    # glue "\nAssistant:" (1 token) after the last text.
    assert pspans(pl) == [
        ("a", "cached", "module", 0, 2),
        ("(text)", "new", "text", 2, 3),  # " one"
        ("(role)", "new", "glue", 3, 4),  # "User: "
        ("(text)", "new", "text", 4, 6),  # "two three"
        ("c", "cached", "module", 5, 6),
        ("(text)", "new", "text", 6, 7),  # " x": tail
        ("(role)", "new", "glue", 7, 8),  # "\nAssistant:"
    ]


def test_reference_order_does_not_change_positions():
    tok = ToyTokenizer()
    lay = layout_schema(FREE, tok)
    a = layout_prompt('<prompt schema="s"><a/><c/></prompt>', lay, tok)
    b = layout_prompt('<prompt schema="s"><c/><a/></prompt>', lay, tok)
    assert pspans(a) == pspans(b) == [("a", "cached", "module", 0, 2), ("c", "cached", "module", 5, 6)]


def test_nested_references():
    tok = ToyTokenizer()
    lay = layout_schema(NESTED_UNION, tok)
    pl = layout_prompt('<prompt schema="s"><m><q><t/></q></m></prompt>', lay, tok)
    assert pspans(pl) == [
        ("m", "cached", "module", 0, 1),
        ("m/q", "cached", "module", 1, 2),
        ("m/q/t", "cached", "module", 2, 3),
        ("m", "cached", "module", 5, 6),
        ("(schema)", "cached", "schema", 6, 7),
    ]
    # a parent without its nested module: the nested span is left out
    pl = layout_prompt('<prompt schema="s"><m/></prompt>', lay, tok)
    assert [s.name for s in pl.spans] == ["m", "m", "(schema)"]


def test_bos_at_position_zero():
    tok = ToyTokenizer(bos=True)
    lay = layout_schema(SEQ, tok)
    assert spans(lay)[:2] == [("(bos)", "bos", 0, 1), ("(schema)", "text", 1, 3)]
    assert lay.end == 8
    pl = layout_prompt("hello world", None, tok)
    assert [(s.name, s.source, s.position_ids) for s in pl.spans] == [("(bos)", "bos", (0,)), ("(text)", "text", (1, 2))]
    assert pl.token_ids[0] == 1


def test_plain_prompt_without_bos_starts_at_zero():
    tok = ToyTokenizer()
    pl = layout_prompt("hello  world", None, tok)
    assert pspans(pl) == [("(text)", "new", "text", 0, 2)]
    assert pl.schema is None and pl.imports == ()


ROLES = (
    '<schema name="s"><system>Be brief.</system>'
    '<user><module name="q">Q one</module></user></schema>'
)  # glue "System: " [0,1), "Be brief." [1,3), glue "\nUser: " [3,4), q [4,6), end 6


def test_role_glue_in_the_schema():
    lay = layout_schema(ROLES, ToyTokenizer())
    assert spans(lay) == [
        ("(role)", "glue", 0, 1),
        ("(schema)", "text", 1, 3),
        ("(role)", "glue", 3, 4),
        ("q", "text", 4, 6),
    ]
    assert lay.glue == ("System: ", "\nUser: ")


def test_prompt_role_equal_to_the_schemas_last_role_continues_it():
    tok = ToyTokenizer()
    lay = layout_schema(ROLES, tok)
    pl = layout_prompt('<prompt schema="s"><q/><user>more</user></prompt>', lay, tok)
    assert pspans(pl)[-2:] == [
        ("(text)", "new", "text", 6, 7),  # " more": no new glue, a separating space
        ("(role)", "new", "glue", 7, 8),  # "\nAssistant:" generation prompt
    ]
    assert tok.decode(pl.token_ids).endswith("Q one more\nAssistant:")


def test_prompt_role_opening_a_new_message():
    tok = ToyTokenizer()
    lay = layout_schema(ROLES, tok)
    pl = layout_prompt('<prompt schema="s"><q/><assistant>Sure</assistant></prompt>', lay, tok)
    assert pspans(pl)[-2:] == [
        ("(role)", "new", "glue", 6, 7),  # "\nAssistant: "
        ("(text)", "new", "text", 7, 8),  # "Sure": the final assistant message is continued, no footer
    ]


def test_cache_false_module_is_new_in_prompts():
    tok = ToyTokenizer()
    lay = layout_schema('<schema name="s">a <module name="m" cache="false">b c</module></schema>', tok)
    assert [s.stored for s in lay.spans] == [True, False]
    pl = layout_prompt('<prompt schema="s"><m/></prompt>', lay, tok)
    assert pspans(pl) == [("(schema)", "cached", "schema", 0, 1), ("m", "new", "module", 1, 3)]


PASSES = (
    '<schema name="s">A <union scaffold="x"><module name="x">x1</module><module name="y">y1 y2</module></union>'
    ' <union><module name="p">p1</module><module name="q">q1</module></union>'
    ' <module name="c" cache="false">c1</module> B</schema>'
)
# spans: 0 "A" [0,1); 1 x [1,2); 2 y [1,3); union0 ends at 3; 3 p [3,4); 4 q [3,4);
# 5 c [4,5) (not stored); 6 " B" [5,6)


def test_encoding_passes():
    lay = layout_schema(PASSES, ToyTokenizer())
    assert spans(lay) == [
        ("(schema)", "text", 0, 1),
        ("x", "text", 1, 2),
        ("y", "text", 1, 3),
        ("p", "text", 3, 4),
        ("q", "text", 3, 4),
        ("c", "text", 4, 5),
        ("(schema)", "text", 5, 6),
    ]
    passes = [(p.key, p.spans, p.targets) for p in lay.passes()]
    assert passes == [
        # default pass: scaffold member x; the scaffold-less union is absent; c is context only
        ((), (0, 1, 5, 6), (0, 1, 6)),
        # every non-scaffold member gets its own pass, over the default context before it
        (((0, "y"),), (0, 2), (2,)),
        (((1, "p"),), (0, 1, 3), (3,)),
        (((1, "q"),), (0, 1, 4), (4,)),
    ]


def test_layout_prompt_accepts_schema_text():
    tok = ToyTokenizer()
    pl = layout_prompt('<prompt schema="s"><b/></prompt>', SEQ, tok)
    assert pspans(pl)[-1] == ("b", "cached", "module", 6, 7)


def test_tables_print_positions():
    tok = ToyTokenizer()
    lay = layout_schema(UNION, tok)
    table = lay.table()
    assert "schema 's': 10 tokens stored, positions [0, 7), 3 modules, 1 union\n" in table
    assert "[1, 5)" in table and "u0:y" in table
    pl = layout_prompt('<prompt schema="s"><y/> tell me</prompt>', lay, tok)
    assert "prompt: 7 cached tokens, 2 new tokens" in pl.table()


def test_print_layout(capsys):
    import promptcache

    promptcache.print_layout(SEQ)
    out = capsys.readouterr().out
    assert out.startswith("schema 's': ") and "tokens stored, positions [0, " in out.splitlines()[0]


def test_argument_too_long_is_an_error_not_a_cut():
    tok = ToyTokenizer()
    with pytest.raises(PMLError, match="argument 'city' of module 'm' is 3 tokens, the parameter allows 2"):
        layout_prompt('<prompt schema="s"><m days="1" city="New York City"/></prompt>', layout_schema(PARAM, tok), tok)


# ---------------------------------------------------------------------------------------------
# Limits, empty prompts, bad text, reprs


def test_max_positions_refuses_a_schema_naming_both_numbers():
    tok = ToyTokenizer()
    assert layout_schema(SEQ, tok, max_positions=7).end == 7
    with pytest.raises(PMLError, match="needs at least 8 positions, more than the model's limit of 7"):
        layout_schema(SEQ.replace("seven", "seven eight"), tok, max_positions=7)


def test_max_positions_refuses_a_huge_parameter_before_building_it():
    big = '<schema name="s"><module name="m">x <parameter name="p" length="1000000"/></module></schema>'
    with pytest.raises(PMLError) as e:
        layout_schema(big, ToyTokenizer(), max_positions=2048)
    assert "1000001 positions" in str(e.value) and "2048" in str(e.value) and e.value.line == 1


def test_max_positions_refuses_a_long_prompt():
    tok = ToyTokenizer()
    lay = layout_schema(SEQ, tok)
    text = " ".join(["w"] * 100)
    pl = layout_prompt(f'<prompt schema="s"><a/> {text}</prompt>', lay, tok, max_positions=106)
    assert max(pl.position_ids) == 105
    with pytest.raises(PMLError, match=r"prompt needs 107 positions \(0..106\), more than the model's limit of 106"):
        layout_prompt(f'<prompt schema="s"><a/> {text} x</prompt>', lay, tok, max_positions=106)
    with pytest.raises(PMLError, match="limit of 50"):
        layout_prompt(text, None, tok, max_positions=50)


@pytest.mark.parametrize("prompt", ["", "   ", "\n\t"])
def test_empty_plain_prompts_are_refused(prompt):
    with pytest.raises(PMLError, match="empty prompt"):
        layout_prompt(prompt, None, ToyTokenizer())


def test_a_prompt_with_no_tokens_is_refused():
    lay = layout_schema('<schema name="e"><module name="m">x</module></schema>', ToyTokenizer())
    with pytest.raises(PMLError, match="empty prompt: it yields no tokens"):
        layout_prompt('<prompt schema="e"/>', lay, ToyTokenizer())


@pytest.mark.parametrize(
    "schema",
    ["", "   ", '<schema name="e"/>', '<schema name="e">\n \n</schema>', '<schema name="e"><module name="m"/></schema>'],
)
def test_empty_schemas_are_refused(schema):
    with pytest.raises(PMLError, match="empty"):
        layout_schema(schema, ToyTokenizer())


def test_lone_surrogates_are_pml_errors():
    tok = ToyTokenizer()
    with pytest.raises(PMLError, match="surrogate"):
        layout_prompt("hello \ud800 world", None, tok)
    with pytest.raises(PMLError):
        layout_schema('<schema name="s">a \udfff b</schema>', tok)
    from promptcache.pml.nodes import Prompt, Text

    with pytest.raises(PMLError, match="U\\+D800"):  # a tree built in Python: caught before the tokenizer
        layout_prompt(Prompt(None, [Text("a \ud800", 1)]), None, tok)


def test_plain_prompts_get_bos_only_when_the_tokenizer_adds_it():
    from promptcache.tokens import GenericSpanTokenizer

    class NoBosText(GenericSpanTokenizer):  # like SmolLM2: declares a BOS it never prepends
        def __init__(self):
            super().__init__(ToyTokenizer())
            self.bos_ids, self.plain_bos_ids = (1,), ()

    pl = layout_prompt("hello there", None, NoBosText())
    assert [s.source for s in pl.spans] == ["text"] and pl.position_ids == [0, 1]
    pl = layout_prompt("hello there", None, ToyTokenizer(bos=True))
    assert pl.token_ids[0] == 1 and pl.position_ids == [0, 1, 2]


def test_reprs_are_short():
    tok = ToyTokenizer()
    big = '<schema name="s">' + "".join(f'<module name="m{i}">{"w " * 200}</module>' for i in range(50)) + "</schema>"
    lay = layout_schema(big, tok)
    pl = layout_prompt('<prompt schema="s"><m0/><m1/> q</prompt>', lay, tok)
    assert len(repr(lay)) < 300 and "50 modules" in repr(lay) and "45 more" in repr(lay)
    assert len(repr(pl)) < 300 and "400 cached + 1 new tokens" in repr(pl)
    assert len(repr(lay.spans[0])) < 120 and len(repr(pl.spans[0])) < 120
