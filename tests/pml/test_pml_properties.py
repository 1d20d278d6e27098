"""Property tests: random schema trees, rendered to PML and laid out, obey the position rules;
random or mutated PML raises only PMLError.

The generated trees carry their own token counts (ToyTokenizer: one token per word), so the
expected walk below is computed from the tree, not from the code under test.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from xml.sax.saxutils import escape, quoteattr

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pml_tokenizers import ToyTokenizer
from promptcache import PMLError, layout_prompt, layout_schema, parse_prompt, parse_schema

SETTINGS = settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])

WORDS = st.lists(st.sampled_from(["a", "bb", "c.", "x&y", "<i>", "'q'", '"d"', "é", "1", "Ω"]), max_size=4)
SPACE = st.sampled_from(["", " ", "\n  ", "\t"])


@dataclass
class T:
    words: list[str]
    pre: str = ""
    post: str = ""


@dataclass
class P:
    length: int
    scaffold: list[str]
    name: str = ""
    pre: str = ""


@dataclass
class M:
    children: list
    cache: bool = True
    name: str = ""


@dataclass
class U:
    members: list[M]
    scaffold: int | None = None


@dataclass
class R:
    role: str
    children: list = field(default_factory=list)


@st.composite
def texts(draw):
    return T(draw(WORDS), draw(SPACE), draw(SPACE))


@st.composite
def params(draw):
    scaffold = draw(st.lists(st.sampled_from(["s", "t"]), max_size=2))
    return P(draw(st.integers(len(scaffold) or 1, 5)), scaffold, pre=draw(SPACE))


@st.composite
def modules(draw, depth: int):
    return M(draw(children(depth - 1, in_module=True)), cache=draw(st.booleans()))


@st.composite
def unions(draw, depth: int):
    members = draw(st.lists(modules(depth), min_size=1, max_size=3))
    scaffold = draw(st.one_of(st.none(), st.integers(0, len(members) - 1)))
    return U(members, scaffold)


@st.composite
def children(draw, depth: int, in_module: bool):
    kinds = [texts()]
    if in_module:
        kinds.append(params())
    if depth > 0:
        kinds += [modules(depth), unions(depth)]
    out = draw(st.lists(st.one_of(kinds), max_size=3))
    merged: list = []
    for c in out:  # adjacent texts would be one run in XML: keep one
        if isinstance(c, T) and merged and isinstance(merged[-1], T):
            continue
        merged.append(c)
    return merged


@st.composite
def schemas(draw):
    body = [M([T(["intro"])])] + draw(children(2, in_module=False))  # never empty (refused)
    if draw(st.booleans()):
        roles = draw(st.lists(st.sampled_from(["system", "user", "assistant"]), min_size=1, max_size=3))
        parts = draw(st.lists(children(2, in_module=False), min_size=len(roles), max_size=len(roles)))
        body = [R(r, p) for r, p in zip(roles, parts)]
    _name(body, iter(range(10**6)))
    return body


def _name(children, counter) -> None:
    for c in children:
        if isinstance(c, M):
            c.name = f"m{next(counter)}"
            _name(c.children, counter)
        elif isinstance(c, P):
            c.name = f"p{next(counter)}"
        elif isinstance(c, U):
            _name(c.members, counter)
        elif isinstance(c, R):
            _name(c.children, counter)


def render(children) -> str:
    out = []
    for c in children:
        if isinstance(c, T):
            out.append(c.pre + escape(" ".join(c.words)) + c.post)
        elif isinstance(c, P):
            scaffold = f" scaffold={quoteattr(' '.join(c.scaffold))}" if c.scaffold else ""
            out.append(f'{c.pre}<parameter name="{c.name}" length="{c.length}"{scaffold}/>')
        elif isinstance(c, M):
            cache = "" if c.cache else ' cache="false"'
            out.append(f'<module name="{c.name}"{cache}>{render(c.children)}</module>')
        elif isinstance(c, U):
            scaffold = "" if c.scaffold is None else f' scaffold="{c.members[c.scaffold].name}"'
            out.append(f"<union{scaffold}>{render(c.members)}</union>")
        elif isinstance(c, R):
            out.append(f"<{c.role}>{render(c.children)}</{c.role}>")
    return "".join(out)


def schema_pml(body) -> str:
    return f'<schema name="gen">\n{render(body)}\n</schema>'


class Expected:
    """The schema walk (docs/pml.md "Positions"), computed from a generated tree."""

    def __init__(self, body):
        self.spans: list[tuple] = []  # (module path, kind, start, length)
        self.modules: dict[tuple, tuple[int, int]] = {}
        self.unions: list[tuple[int, int]] = []  # (start, length), document order
        pos = 0
        for i, c in enumerate(body):
            if isinstance(c, R):
                self.spans.append(((), "glue", pos, 1))  # "System: " / "\nUser: " ...: one toy token
                pos = self.walk(c.children, (), pos + 1)
            else:
                pos = self.walk([c], (), pos)
        self.end = pos

    def walk(self, children, path, pos) -> int:
        for c in children:
            if isinstance(c, T) and c.words:
                self.spans.append((path, "text", pos, len(c.words)))
                pos += len(c.words)
            elif isinstance(c, P):
                self.spans.append((path, "param", pos, c.length))
                pos += c.length
            elif isinstance(c, M):
                pos = self.module(c, path, pos)
            elif isinstance(c, U):
                self.unions.append(None)
                slot = len(self.unions) - 1
                longest = max(self.module(m, path, pos) - pos for m in c.members)
                self.unions[slot] = (pos, longest)
                pos += longest
        return pos

    def module(self, m: M, path, pos) -> int:
        end = self.walk(m.children, path + (m.name,), pos)
        self.modules[path + (m.name,)] = (pos, end)
        return end


@SETTINGS
@given(schemas())
def test_schema_layout(body):
    lay = layout_schema(schema_pml(body), ToyTokenizer())
    check_walk_matches_the_tree(lay, body)
    check_spans_overlap_only_across_members_of_one_union(lay)
    check_spans_are_contiguous_along_the_walk(lay)
    check_encoding_passes(lay)


def check_walk_matches_the_tree(lay, body):
    want = Expected(body)
    assert [(s.module, s.kind, s.start, len(s.token_ids)) for s in lay.spans] == want.spans
    assert {p: (m.start, m.end) for p, m in lay.modules.items()} == want.modules
    assert [(u.start, u.length) for _, u in sorted(lay.unions.items())] == want.unions
    assert lay.end == want.end


def check_spans_overlap_only_across_members_of_one_union(lay):
    for i, a in enumerate(lay.spans):
        for b in lay.spans[i + 1 :]:
            if a.start < b.end and b.start < a.end:
                ca, cb = dict(a.choices), dict(b.choices)
                assert any(u in cb and cb[u] != m for u, m in ca.items()), (a, b)


def check_spans_are_contiguous_along_the_walk(lay):
    pos = 0
    for s in lay.spans:
        # a span starts where the previous one ended, at a union's start, or just after a union
        starts = {pos} | {u.start for u in lay.unions.values()} | {u.start + u.length for u in lay.unions.values()}
        assert s.start in starts, s
        pos = s.end
    for u in lay.unions.values():
        members = [lay.modules[u.parent + (m,)] for m in u.members]
        assert all(m.start == u.start for m in members)
        assert u.length == max(m.end - m.start for m in members)


def check_encoding_passes(lay):
    """Each stored span is the target of exactly one pass, whose sequence up to it is its encoding
    context: the spans before it whose unions are set to its own members, or else to the union's
    scaffold (a union without scaffold is absent)."""
    passes = lay.passes()
    targets = [t for p in passes for t in p.targets]
    assert sorted(targets) == [s.index for s in lay.spans if s.stored]
    scaffold = {u.index: u.scaffold for u in lay.unions.values()}
    for p in passes:
        assert list(p.spans) == sorted(p.spans) and p.spans[-1] == p.targets[-1]
        for t in p.targets:
            mine = dict(lay.spans[t].choices)
            context = [
                s.index
                for s in lay.spans[: t + 1]
                if all(m == mine.get(u, scaffold[u]) for u, m in s.choices)
            ]
            assert [i for i in p.spans if i <= t] == context, (p, t)


@st.composite
def prompts(draw, body):
    """A valid prompt for `body`: modules imported (one member per union), arguments within slots."""
    scope = [c for c in body if not isinstance(c, R)] + [x for c in body if isinstance(c, R) for x in c.children]
    refs = draw(_refs(scope))
    items = [" lead w"] if draw(st.booleans()) else []  # text before the first import
    for ref in draw(st.permutations(refs)):
        items.append(ref)
        if draw(st.booleans()):
            items.append(" " + " ".join(draw(st.lists(st.sampled_from(["w", "v."]), min_size=1, max_size=3))))
    return items


@st.composite
def _refs(draw, scope):
    out = []
    for c in scope:
        picks = []
        if isinstance(c, M) and draw(st.booleans()):
            picks = [c]
        elif isinstance(c, U):
            picks = draw(st.sampled_from([[]] + [[m] for m in c.members]))
        for m in picks:
            args = {}
            for p in (x for x in m.children if isinstance(x, P)):
                args[p.name] = " ".join(draw(st.lists(st.sampled_from(["A", "b&c"]), max_size=p.length)))
            out.append((m, args, draw(_refs([x for x in m.children if isinstance(x, (M, U))]))))
    return out


def render_refs(refs) -> str:
    return "".join(
        f"<{m.name}{''.join(f' {k}={quoteattr(v)}' for k, v in args.items())}>{render_refs(sub)}</{m.name}>"
        for m, args, sub in refs
    )


@SETTINGS
@given(st.data())
def test_prompt_layout_keeps_schema_positions(data):
    body = data.draw(schemas())
    tok = ToyTokenizer()
    lay = layout_schema(schema_pml(body), tok)
    items = data.draw(prompts(body))
    text = "".join(render_refs([i]) if isinstance(i, tuple) else escape(i) for i in items)
    try:
        pl = layout_prompt(f'<prompt schema="gen">{text}</prompt>', lay, tok)
    except PMLError as e:  # only a prompt with no tokens at all: the same prompt plus a word is just that word
        assert "empty prompt" in str(e)
        plus = layout_prompt(f'<prompt schema="gen">{text} zz</prompt>', lay, tok)
        assert [s.source for s in plus.spans] == ["text"] and plus.token_ids == tok.encode(" zz")
        return
    taken: set[int] = set()
    for s in pl.spans:
        assert list(s.position_ids) == list(range(s.position_ids[0], s.position_ids[0] + len(s)))
        if s.schema_index is None:
            continue
        ss = lay.spans[s.schema_index]
        if s.source == "argument":
            assert s.position_ids[0] == ss.start and len(s) <= len(ss.token_ids)
        else:
            assert (s.position_ids[0], s.token_ids) == (ss.start, ss.token_ids)
        assert taken.isdisjoint(s.position_ids), s  # one member per union: no two schema spans collide
        taken.update(s.position_ids)
    # free text: between two imports it continues the module before it; after the last import (or
    # with none) it follows the last included schema span; before the first import it follows the
    # last included schema span before that module's first span. Text at one anchor continues.
    included = {s.index: s.end for s in lay.spans if all(s.module[: k + 1] in pl.imports for k in range(len(s.module)))}
    refs = [n for n, i in enumerate(items) if isinstance(i, tuple)]
    cursor, want = {}, []
    for n, i in enumerate(items):
        if isinstance(i, tuple):
            continue
        size = len(i.split())
        before = [r for r in refs if r < n]
        if before and any(r > n for r in refs):
            info = lay.modules[(items[before[-1]][0].name,)]
            anchor, start = info.last_span, info.end
        elif before or not refs:
            anchor = max(included, default=-1)
            start = included.get(anchor, 0)
        else:
            path = (items[refs[0]][0].name,)
            first = min((s.index for s in lay.spans if s.module[:1] == path), default=lay.modules[path].last_span + 1)
            anchor = max((k for k in included if k < first), default=-1)
            start = included.get(anchor, 0)
        start = cursor.get(anchor, start)
        cursor[anchor] = start + size
        if size:
            want.append((start, size))
    got = [(s.position_ids[0], len(s)) for s in pl.spans if s.source == "text"]
    assert sorted(got) == sorted(want)


# ---------------------------------------------------------------------------------------------
# Random and mutated input: PMLError or success, nothing else

MARKUP = st.sampled_from(list("<>/=\"'&; !-?[]\n") + ["<module", "</module>", 'name="m"', "<union>", "length=",
                                                       "<parameter", "/>", "&amp;", "<!--", "-->", "<![CDATA[",
                                                       "scaffold=", "<user>", "<plan", "<!DOCTYPE x>", "src="])


@st.composite
def mutated(draw, base: str):
    text = base
    for _ in range(draw(st.integers(1, 4))):
        i = draw(st.integers(0, len(text)))
        op = draw(st.sampled_from(["insert", "delete", "duplicate"]))
        if op == "insert":
            text = text[:i] + draw(st.one_of(MARKUP, st.text(max_size=3))) + text[i:]
        elif op == "delete":
            text = text[:i] + text[i + draw(st.integers(1, 8)) :]
        else:
            j = draw(st.integers(i, min(len(text), i + 12)))
            text = text[:j] + text[i:j] + text[j:]
    return text


def only_pml_errors(fn, *args) -> None:
    try:
        fn(*args)
    except PMLError:
        pass


def _schema_then_layout(text: str) -> None:
    layout_schema(parse_schema(text), ToyTokenizer())


@SETTINGS
@given(st.data())
def test_mutated_schemas_raise_only_pml_errors(data):
    text = data.draw(mutated(schema_pml(data.draw(schemas()))))
    only_pml_errors(_schema_then_layout, text)


@SETTINGS
@given(st.text(max_size=60), st.booleans())
def test_random_text_raises_only_pml_errors(text, as_prompt):
    fn = parse_prompt if as_prompt else parse_schema
    only_pml_errors(fn, "<" + text)
    only_pml_errors(fn, text)


@SETTINGS
@given(st.data())
def test_mutated_prompts_raise_only_pml_errors(data):
    body = data.draw(schemas())
    tok = ToyTokenizer()
    lay = layout_schema(schema_pml(body), tok)
    items = data.draw(prompts(body))
    text = "".join(render_refs([i]) if isinstance(i, tuple) else escape(i) for i in items)
    bad = data.draw(mutated(f'<prompt schema="gen">{text}<user>hi</user></prompt>'))
    only_pml_errors(lambda: layout_prompt(parse_prompt(bad), lay, tok))
