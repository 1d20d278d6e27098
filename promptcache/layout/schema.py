"""Schema tree + tokenizer -> ``SchemaLayout``: spans with token IDs and positions. Torch-free.

The walk is in document order: each span starts where the previous one ends; the members of a
union all start at the union's start, and the walk resumes at start + longest member.
Parameters reserve ``length`` positions (their placeholder: the scaffold padded with the pad id).
A schema whose range exceeds ``max_positions`` is refused as soon as the walk passes the limit,
before a long placeholder is built.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterable

from ..pml.errors import PMLError
from ..pml.nodes import Module, Parameter, Role, Schema, Text, Union
from ..pml.parser import parse_schema
from ..tokens import SpanTokenizer, as_span_tokenizer, encode_checked
from .spans import ModuleInfo, Path_, SchemaLayout, SchemaSpan, UnionInfo


class _SchemaWalker:
    def __init__(self, schema: Schema, tok: SpanTokenizer, max_positions: int | None):
        self.schema, self.tok, self.max_positions = schema, tok, max_positions
        self.spans: list[SchemaSpan] = []
        self.modules: dict[Path_, ModuleInfo] = {}
        self.unions: dict[int, UnionInfo] = {}
        self.pos = 0

    def check_room(self, n: int, line: int | None) -> None:
        """Refuse a schema whose walk reaches past ``max_positions`` (position pos + n - 1)."""
        if self.max_positions is not None and self.pos + n > self.max_positions:
            raise PMLError(
                f"schema '{self.schema.name}' needs at least {self.pos + n} positions, more than the "
                f"model's limit of {self.max_positions}",
                self.schema.source,
                line,
            )

    def encode(self, text: str, line: int | None) -> list[int]:
        return encode_checked(self.tok, text, self.schema.source, line)

    def emit(self, kind: str, ids: Iterable[int], module: Path_ = (), choices=(), cache=True, line=None, **kw) -> None:
        ids = tuple(ids)
        if ids:
            self.check_room(len(ids), line)
            self.spans.append(SchemaSpan(len(self.spans), kind, module, ids, self.pos, tuple(choices), cache, **kw))
            self.pos += len(ids)

    def walk(self, children: list, path: Path_, choices: tuple, cache: bool, union: int | None = None) -> None:
        for c in children:
            if isinstance(c, Text):
                self.emit("text", self.encode(c.text, c.line), path, choices, cache, c.line)
            elif isinstance(c, Parameter):
                self.check_room(c.length, c.line)
                ids = self.placeholder(c, path)
                self.emit("param", ids, path, choices, cache, c.line, param=c.name, lead_space=c.lead_space)
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
        params = {
            s.param: (s.index, _find_param(m, s.param))
            for s in self.spans[first:]
            if s.kind == "param" and s.module == p
        }
        self.modules[p] = ModuleInfo(p, start, self.pos, cache and m.cache, union, params, len(self.spans) - 1, m.line)

    def placeholder(self, p: Parameter, path: Path_) -> list[int]:
        ids = self.encode((" " if p.lead_space else "") + p.scaffold, p.line) if p.scaffold else []
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


def layout_schema(
    schema: Schema | str | Path,
    tokenizer,
    *,
    max_positions: int | None = None,
    allow_src_root: str | Path | None = None,
) -> SchemaLayout:
    """Lay out a schema (tree, PML text as a ``str``, or a file as a ``pathlib.Path``): spans with token IDs and positions.

    ``max_positions``: the model's context (positions 0..max_positions-1); a schema needing more
    is a PMLError naming both numbers. ``allow_src_root`` is passed to ``parse_schema``. A schema
    that yields no token at all is a PMLError.
    """
    if not isinstance(schema, Schema):
        schema = parse_schema(schema, allow_src_root=allow_src_root)
    tok = as_span_tokenizer(tokenizer)
    w = _SchemaWalker(schema, tok, max_positions)
    w.emit("bos", tok.bos_ids)
    roles = schema.roles
    glue = tuple(tok.render_roles(roles, add_generation_prompt=False)[: len(roles)]) if roles else ()
    n_role = 0
    for c in schema.children:
        if isinstance(c, Role):
            w.emit("glue", w.encode(glue[n_role], c.line), line=c.line)
            n_role += 1
            w.walk(c.children, (), (), True)
        else:
            w.walk([c], (), (), True)
    if not any(s.kind != "bos" for s in w.spans):
        reason = f"schema '{schema.name}' yields no tokens (its text and modules are empty)"
        raise PMLError(reason, schema.source, schema.line)
    return SchemaLayout(schema, w.spans, w.modules, w.unions, w.pos, glue)
