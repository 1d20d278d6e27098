"""The data a layout produces: schema spans, module and union facts, encoding passes, prompt spans.

Plain data (no tokenizer, no torch). Reprs are short (counts and a preview); ``table()`` prints
every span. Positions are half-open ranges ``[start, end)`` of position IDs.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..pml.nodes import Parameter, Schema

Path_ = tuple[str, ...]  # a module's path: names from the schema root


@dataclass(frozen=True, repr=False)
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

    def __repr__(self) -> str:
        n = len(self.token_ids)
        return f"SchemaSpan({self.index}, {self.kind}, {self.name!r}, {n} tokens at [{self.start}, {self.end}))"


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


@dataclass(repr=False)
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

    @property
    def stored_tokens(self) -> int:
        """Tokens whose states are stored: the one token count of a schema that ``compile``, its
        progress line, ``inspect`` and ``validate`` print (with ``end``, its positions)."""
        return sum(len(s.token_ids) for s in self.spans if s.stored)

    def summary(self) -> str:
        """'60 tokens stored, positions [0, 58)': how every command counts a schema."""
        return f"{self.stored_tokens} tokens stored, positions [0, {self.end})"

    def passes(self) -> list[EncodePass]:
        """The encoding passes (docs/pml.md "Positions": each module is encoded over the schema text before it,
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
            stored = "yes" if s.stored else "no"
            rows.append((s.name, kind, f"[{s.start}, {s.end})", str(len(s.token_ids)), union, stored))
        title = (
            f"schema '{self.name}': {self.summary()}, {_count(len(self.modules), 'module')}, "
            f"{_count(len(self.unions), 'union')}"
        )
        return title + "\n" + format_rows(rows)

    def __repr__(self) -> str:
        return (
            f"SchemaLayout({self.name!r}, positions [0, {self.end}), {_count(len(self.spans), 'span')}, "
            f"{_count(len(self.modules), 'module')}, {_count(len(self.unions), 'union')}, "
            f"modules: {_preview(['/'.join(p) for p in self.modules])})"
        )


@dataclass(frozen=True, repr=False)
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

    def __repr__(self) -> str:
        rng = f"[{self.position_ids[0]}, {self.position_ids[-1] + 1})" if self.position_ids else "[]"
        return f"Span({self.kind}, {self.name!r}, {self.source}, {len(self)} tokens at {rng})"


@dataclass(repr=False)
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
        n_pos = max(self.position_ids, default=-1) + 1
        return f"prompt: {n_c} cached tokens, {n_n} new tokens, positions [0, {n_pos})\n" + format_rows(rows)

    def __repr__(self) -> str:
        n_c = sum(len(s) for s in self.cached)
        n_n = sum(len(s) for s in self.new)
        schema = repr(self.schema.name) if self.schema is not None else None
        return (
            f"PromptLayout(schema={schema}, {_count(len(self.spans), 'span')}, {n_c} cached + {n_n} new tokens, "
            f"positions [0, {max(self.position_ids, default=-1) + 1}), spans: {_preview([s.name for s in self.spans])})"
        )


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}{'' if n == 1 else 's'}"


def _preview(names: list[str], k: int = 5) -> str:
    """The first k names, then how many more: a repr stays short for any schema."""
    head = ", ".join(names[:k])
    return f"[{head}{f', ... {len(names) - k} more' if len(names) > k else ''}]"


def format_rows(rows: list[tuple[str, ...]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows)


