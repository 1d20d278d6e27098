"""Trees + tokenizer -> spans with token IDs and position IDs (DESIGN.md section 3). Torch-free.

Schema layout is a walk in document order: each span starts where the previous one ends; the
members of a union all start at the union's start, and the walk resumes at start + longest
member. Parameters reserve ``length`` positions.

Prompt layout: imported modules keep their schema positions; parameter arguments take the first
positions of their slot; free text (and chat-role glue) between two module references starts at
the end of the module before it; text before the first or after the last reference (or in a
prompt with no reference) is placed from the end of the schema's range. Consecutive new spans
continue one another. Prompt order (the order of ``PromptLayout.spans``) is schema order for
module content, with free text right after the module it follows and unanchored text last;
the order in which references are written does not change positions.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable

from .pml.errors import PMLError
from .pml.nodes import Module, ModuleRef, Parameter, Prompt, PromptRole, Role, Schema, Text, Union
from .pml.parser import parse_prompt, parse_schema
from .tokens import SpanTokenizer, as_span_tokenizer

Path_ = tuple[str, ...]  # a module's path: names from the schema root


@dataclass(frozen=True)
class SchemaSpan:
    """A leaf of the schema walk: a run of tokens owned by one module (or the schema itself)."""

    index: int
    kind: str  # "bos" | "glue" | "text" | "param"
    module: Path_  # owning module; () for anonymous schema text
    token_ids: tuple[int, ...]  # for "param": the placeholder, exactly the slot length
    start: int
    choices: tuple[tuple[int, str], ...] = ()  # (union index, member) this span lies in, outer first
    cache: bool = True  # False inside a cache="false" module
    param: str | None = None
    lead_space: bool = False  # "param": arguments get a leading space

    @property
    def end(self) -> int:
        return self.start + len(self.token_ids)

    @property
    def name(self) -> str:
        if self.kind == "param":
            return f"{'/'.join(self.module)}.{self.param}"
        if self.module:
            return "/".join(self.module)
        return {"bos": "(bos)", "glue": "(role)"}.get(self.kind, "(schema)")

    @property
    def stored(self) -> bool:
        """Whether this span's key/value states are computed at encode time and stored."""
        return self.cache and self.kind != "param"


@dataclass(frozen=True)
class ModuleInfo:
    path: Path_
    start: int
    end: int
    cache: bool
    union: int | None  # index of the union this module is a member of
    params: dict[str, tuple[int, Parameter]]  # name -> (span index, parameter)
    last_span: int  # index of the last span inside the module (or before it, if it is empty)
    line: int


@dataclass(frozen=True)
class UnionInfo:
    index: int
    start: int
    length: int
    scaffold: str | None
    members: tuple[str, ...]
    parent: Path_
    line: int


@dataclass(frozen=True)
class EncodePass:
    """One forward pass of encoding: the schema with some unions set to non-scaffold members.

    ``spans`` is the pass's sequence (span indices, in order, ending at its last target);
    ``targets`` are the stored spans whose states this pass provides.
    """

    key: tuple[tuple[int, str], ...]  # overrides of the scaffold defaults; () is the default pass
    spans: tuple[int, ...]
    targets: tuple[int, ...]


@dataclass
class SchemaLayout:
    schema: Schema
    spans: list[SchemaSpan]
    modules: dict[Path_, ModuleInfo]
    unions: dict[int, UnionInfo]
    end: int  # one past the last position of the schema's range
    glue: tuple[str, ...]  # rendered role glue before each schema role's content

    @property
    def name(self) -> str:
        return self.schema.name

    def passes(self) -> list[EncodePass]:
        """The encoding passes (DESIGN.md: each module is encoded over the schema text before it,
        unions represented by their scaffold member, or absent without one; every other member
        in a pass where it is the selected member). The default pass comes first."""
        defaults = {u.index: u.scaffold for u in self.unions.values()}
        homes: dict[tuple, list[int]] = {(): []}
        for s in self.spans:
            if s.stored:
                key = tuple(c for c in s.choices if defaults[c[0]] != c[1])
                homes.setdefault(key, []).append(s.index)
        out = []
        for key, targets in homes.items():
            if not targets:
                continue
            assign = {**defaults, **dict(key)}
            last = targets[-1]
            seq = tuple(
                s.index for s in self.spans if s.index <= last and all(assign[u] == m for u, m in s.choices)
            )
            out.append(EncodePass(key, seq, tuple(targets)))
        return out

    def table(self) -> str:
        """A printable table of the schema's spans: name, kind, positions, tokens, union, cache."""
        rows = [("name", "kind", "positions", "tokens", "union", "cache")]
        for s in self.spans:
            union = ",".join(f"u{u}:{m}" for u, m in s.choices) or "-"
            kind = "param" if s.kind == "param" else ("module" if s.module else s.kind)
            rows.append((s.name, kind, f"[{s.start}, {s.end})", str(len(s.token_ids)), union, "yes" if s.stored else "no"))
        title = f"schema '{self.name}': positions [0, {self.end}), {len(self.modules)} modules, {len(self.unions)} unions"
        return title + "\n" + _format_rows(rows)


@dataclass(frozen=True)
class Span:
    """One span of a prompt, as the engine sees it."""

    kind: str  # "cached" | "new"
    name: str
    token_ids: tuple[int, ...]
    position_ids: tuple[int, ...]
    source: str  # "bos" | "glue" | "schema" | "module" | "argument" | "text"
    schema_index: int | None = None  # the SchemaSpan this comes from (None for prompt text)

    def __len__(self) -> int:
        return len(self.token_ids)


@dataclass
class PromptLayout:
    spans: list[Span]  # prompt order
    schema: SchemaLayout | None
    imports: tuple[Path_, ...] = field(default_factory=tuple)

    def __iter__(self):
        return iter(self.spans)

    def __len__(self) -> int:
        return len(self.spans)

    def __getitem__(self, i):
        return self.spans[i]

    @property
    def cached(self) -> list[Span]:
        return [s for s in self.spans if s.kind == "cached"]

    @property
    def new(self) -> list[Span]:
        return [s for s in self.spans if s.kind == "new"]

    @property
    def token_ids(self) -> list[int]:
        return [t for s in self.spans for t in s.token_ids]

    @property
    def position_ids(self) -> list[int]:
        return [p for s in self.spans for p in s.position_ids]

    def table(self) -> str:
        rows = [("name", "kind", "source", "positions", "tokens")]
        for s in self.spans:
            rng = f"[{s.position_ids[0]}, {s.position_ids[-1] + 1})" if s.position_ids else "-"
            rows.append((s.name, s.kind, s.source, rng, str(len(s))))
        n_c = sum(len(s) for s in self.cached)
        n_n = sum(len(s) for s in self.new)
        return f"prompt: {n_c} cached tokens, {n_n} new tokens\n" + _format_rows(rows)


def _format_rows(rows: list[tuple[str, ...]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows)


# ---------------------------------------------------------------------------------------------
# Schema walk


class _SchemaWalker:
    def __init__(self, schema: Schema, tok: SpanTokenizer):
        self.schema, self.tok = schema, tok
        self.spans: list[SchemaSpan] = []
        self.modules: dict[Path_, ModuleInfo] = {}
        self.unions: dict[int, UnionInfo] = {}
        self.pos = 0

    def emit(self, kind: str, ids: Iterable[int], module: Path_ = (), choices=(), cache=True, **kw) -> None:
        ids = tuple(ids)
        if ids:
            self.spans.append(SchemaSpan(len(self.spans), kind, module, ids, self.pos, tuple(choices), cache, **kw))
            self.pos += len(ids)

    def walk(self, children: list, path: Path_, choices: tuple, cache: bool, union: int | None = None) -> None:
        for c in children:
            if isinstance(c, Text):
                self.emit("text", self.tok.encode(c.text), path, choices, cache)
            elif isinstance(c, Parameter):
                self.emit("param", self.placeholder(c, path), path, choices, cache, param=c.name, lead_space=c.lead_space)
            elif isinstance(c, Module):
                self.module(c, path, choices, cache, union)
            elif isinstance(c, Union):
                start, longest = self.pos, 0
                for m in c.members:
                    self.pos = start
                    self.module(m, path, choices + ((c.index, m.name),), cache, c.index)
                    longest = max(longest, self.pos - start)
                self.pos = start + longest
                names = tuple(m.name for m in c.members)
                self.unions[c.index] = UnionInfo(c.index, start, longest, c.scaffold, names, path, c.line)

    def module(self, m: Module, path: Path_, choices: tuple, cache: bool, union: int | None) -> None:
        p, start = path + (m.name,), self.pos
        first = len(self.spans)
        self.walk(m.children, p, choices, cache and m.cache)
        params = {s.param: (s.index, _find_param(m, s.param)) for s in self.spans[first:] if s.kind == "param" and s.module == p}
        self.modules[p] = ModuleInfo(p, start, self.pos, cache and m.cache, union, params, len(self.spans) - 1, m.line)

    def placeholder(self, p: Parameter, path: Path_) -> list[int]:
        ids = self.tok.encode((" " if p.lead_space else "") + p.scaffold) if p.scaffold else []
        if len(ids) > p.length:
            raise PMLError(
                f"parameter '{p.name}' of module '{'/'.join(path)}': scaffold is {len(ids)} tokens, "
                f"the parameter allows {p.length}",
                self.schema.source,
                p.line,
            )
        return ids + [self.tok.pad_id] * (p.length - len(ids))


def _find_param(m: Module, name: str) -> Parameter:
    return next(c for c in m.children if isinstance(c, Parameter) and c.name == name)


def layout_schema(schema: Schema | str | Path, tokenizer) -> SchemaLayout:
    """Lay out a schema (tree, PML text or path): spans with token IDs and positions."""
    if not isinstance(schema, Schema):
        schema = parse_schema(schema)
    tok = as_span_tokenizer(tokenizer)
    w = _SchemaWalker(schema, tok)
    w.emit("bos", tok.bos_ids)
    roles = schema.roles
    glue = tuple(tok.render_roles(roles, add_generation_prompt=False)[: len(roles)]) if roles else ()
    n_role = 0
    for c in schema.children:
        if isinstance(c, Role):
            w.emit("glue", tok.encode(glue[n_role]))
            n_role += 1
            w.walk(c.children, (), (), True)
        else:
            w.walk([c], (), (), True)
    return SchemaLayout(schema, w.spans, w.modules, w.unions, w.pos, glue)


# ---------------------------------------------------------------------------------------------
# Prompt layout


@dataclass
class _Item:
    """A piece of the prompt stream: a top-level module reference, free text or role glue."""

    kind: str  # "ref" | "text" | "glue"
    text: str = ""
    path: Path_ = ()
    line: int | None = None


class _PromptResolver:
    def __init__(self, prompt: Prompt, layout: SchemaLayout):
        self.prompt, self.layout = prompt, layout
        self.imported: dict[Path_, ModuleRef] = {}
        self.union_choice: dict[int, str] = {}

    def error(self, msg: str, line: int) -> PMLError:
        return PMLError(msg, self.prompt.source, line)

    def resolve(self, refs: list[ModuleRef], scope: Path_) -> None:
        for ref in refs:
            path = scope + (ref.name,)
            info = self.layout.modules.get(path)
            if info is None:
                known = sorted(p[-1] for p in self.layout.modules if p[:-1] == scope)
                where = f"inside '{'/'.join(scope)}'" if scope else "at the top level"
                raise self.error(
                    f"unknown module '{ref.name}' {where} of schema '{self.layout.name}' "
                    f"(known: {', '.join(known) or 'none'})",
                    ref.line,
                )
            if path in self.imported:
                raise self.error(f"module '{'/'.join(path)}' imported twice", ref.line)
            if info.union is not None:
                other = self.union_choice.get(info.union)
                if other is not None:
                    raise self.error(
                        f"two members of one union imported: '{other}' and '{ref.name}' (a union allows one)",
                        ref.line,
                    )
                self.union_choice[info.union] = ref.name
            for arg in ref.args:
                if arg not in info.params:
                    known = ", ".join(info.params) or "none"
                    raise self.error(f"module '{ref.name}' has no parameter '{arg}' (parameters: {known})", ref.line)
            missing = [p for p in info.params if p not in ref.args]
            if missing:
                raise self.error(f"module '{ref.name}' needs an argument for parameter(s): {', '.join(missing)}", ref.line)
            self.imported[path] = ref
            self.resolve(ref.children, path)


def layout_prompt(
    prompt: Prompt | str | Path, schema: SchemaLayout | Schema | str | Path | None, tokenizer
) -> PromptLayout:
    """Lay out a prompt against its schema's layout (None for a plain prompt). ``schema`` may
    also be a schema tree, PML text or path; it is then laid out with ``tokenizer``."""
    if not isinstance(prompt, Prompt):
        prompt = parse_prompt(prompt)
    tok = as_span_tokenizer(tokenizer)
    if schema is not None and not isinstance(schema, SchemaLayout):
        schema = layout_schema(schema, tok)
    if prompt.schema is not None:
        if schema is None:
            raise PMLError(f"unknown schema '{prompt.schema}'", prompt.source, prompt.line)
        if schema.name != prompt.schema:
            raise PMLError(
                f"prompt is for schema '{prompt.schema}', not '{schema.name}'", prompt.source, prompt.line
            )
    elif schema is not None:
        schema = None  # a plain prompt ignores any schema
    resolver = None
    if schema is not None:
        resolver = _PromptResolver(prompt, schema)
        resolver.resolve(
            [c for c in prompt.children if isinstance(c, ModuleRef)]
            + [r for c in prompt.children if isinstance(c, PromptRole) for r in c.children if isinstance(r, ModuleRef)],
            (),
        )
    items = _prompt_items(prompt, schema, tok)
    return _PromptBuilder(prompt, schema, tok, resolver).build(items)


def _prompt_items(prompt: Prompt, schema: SchemaLayout | None, tok: SpanTokenizer) -> list[_Item]:
    """Flatten the prompt into references, texts and role glue (chat template applied)."""
    schema_roles = list(schema.schema.roles) if schema else []
    messages = list(schema_roles)
    items: list[_Item] = []
    glue_at: list[tuple[int, int]] = []  # (item position, message index)

    def add(children):
        for c in children:
            if isinstance(c, ModuleRef):
                items.append(_Item("ref", path=(c.name,), line=c.line))
            elif isinstance(c, Text):
                items.append(_Item("text", c.text, line=c.line))

    for c in prompt.children:
        if isinstance(c, PromptRole):
            if not messages or messages[-1] != c.role:  # same role as the last message continues it
                messages.append(c.role)
                glue_at.append((len(items), len(messages) - 1))
                items.append(_Item("glue", line=c.line))
                add(c.children)
            else:
                first = len(items)
                add(c.children)
                if first < len(items) and items[first].kind == "text" and not items[first].text[:1].isspace():
                    items[first].text = " " + items[first].text  # a continued message: separate its text
        else:
            add([c])
    if not messages:
        return items
    pieces = tok.render_roles(messages, add_generation_prompt=messages[-1] != "assistant")
    if schema and tuple(pieces[: len(schema_roles)]) != schema.glue:
        raise PMLError(
            "the chat template renders the schema's roles differently once the prompt's roles are added",
            prompt.source,
            prompt.line,
        )
    for at, msg in glue_at:
        items[at].text = pieces[msg]
    items.append(_Item("glue", pieces[len(messages)]))
    return items


class _PromptBuilder:
    def __init__(self, prompt: Prompt, schema: SchemaLayout | None, tok: SpanTokenizer, resolver):
        self.prompt, self.schema, self.tok, self.resolver = prompt, schema, tok, resolver

    def build(self, items: list[_Item]) -> PromptLayout:
        tok, schema = self.tok, self.schema
        out: list[tuple[tuple, Span]] = []  # (sort key, span)
        if schema is None:
            tail = len(tok.bos_ids)
            if tok.bos_ids:
                out.append(((-1,), Span("new", "(bos)", tuple(tok.bos_ids), tuple(range(tail)), "bos")))
            imported: dict = {}
        else:
            tail = schema.end
            imported = self.resolver.imported
            out += [((s.index, 0), span) for s in schema.spans if self._included(s, imported) for span in self._schema_span(s, imported)]
        refs = [i for i, it in enumerate(items) if it.kind == "ref"]
        cursors: dict[Path_, int] = {}
        for n, it in enumerate(items):
            if it.kind == "ref" or not it.text:
                continue
            ids = tuple(tok.encode(it.text))
            if not ids:
                continue
            before = [r for r in refs if r < n]
            anchored = before and any(r > n for r in refs)
            if anchored:
                info = schema.modules[items[before[-1]].path]
                start = cursors.get(info.path, info.end)
                cursors[info.path] = start + len(ids)
                key = (info.last_span, 1, n)
            else:
                start, tail = tail, tail + len(ids)
                key = (float("inf"), 1, n)
            name = "(text)" if it.kind == "text" else "(role)"
            out.append((key, Span("new", name, ids, tuple(range(start, start + len(ids))), it.kind)))
        out.sort(key=lambda kv: kv[0])
        return PromptLayout([s for _, s in out], schema, tuple(imported))

    @staticmethod
    def _included(s: SchemaSpan, imported) -> bool:
        return all(s.module[: i + 1] in imported for i in range(len(s.module)))

    def _schema_span(self, s: SchemaSpan, imported) -> list[Span]:
        if s.kind != "param":
            source = s.kind if s.kind in ("bos", "glue") else ("module" if s.module else "schema")
            kind = "cached" if s.stored else "new"
            return [Span(kind, s.name, s.token_ids, tuple(range(s.start, s.end)), source, s.index)]
        ref = imported[s.module]
        arg = ref.args[s.param]
        ids = tuple(self.tok.encode((" " if s.lead_space else "") + arg)) if arg else ()
        if len(ids) > len(s.token_ids):
            raise PMLError(
                f"argument '{s.param}' of module '{'/'.join(s.module)}' is {len(ids)} tokens, "
                f"the parameter allows {len(s.token_ids)}",
                self.prompt.source,
                ref.line,
            )
        if not ids:
            return []
        return [Span("new", s.name, ids, tuple(range(s.start, s.start + len(ids))), "argument", s.index)]
