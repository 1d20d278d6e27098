"""Prompt tree + schema layout + tokenizer -> ``PromptLayout``. Torch-free.

Imports are checked by ``pml.rules.resolve_imports`` (the rule set the builder uses too).
Positions (docs/pml.md "Positions"):

* imported modules keep their schema positions; parameter arguments take the first positions of
  their slot; union members and parameters keep the schema's rules;
* free text (and chat-role glue) between two module references starts at the end of the module
  before it (the paper's rule);
* text after the last reference, and all text of a prompt with no reference, starts right after
  the last schema span included before it (the schema's anonymous text, BOS and role glue are
  in every prompt): never after the schema's end, so a prompt importing a prefix of the schema
  has contiguous positions 0..n-1 and equals a plain prefill;
* text before the first reference is placed just before that module in prompt order and starts
  right after the last included schema span before it (after BOS and the schema text that
  precedes the module; 0 when there is none);
* consecutive new spans continue one another.

Prompt order (the order of ``PromptLayout.spans``) is schema order for schema spans, with free
text right after the span it follows; the order references are written in does not change
positions. A prompt that yields no tokens, or whose positions exceed ``max_positions``, is a
PMLError.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ..pml.errors import PMLError, raise_collected
from ..pml.nodes import ModuleRef, Prompt, PromptRole, Schema, Text
from ..pml.parser import parse_prompt
from ..pml.rules import resolve_imports
from ..tokens import SpanTokenizer, as_span_tokenizer, encode_checked
from .schema import layout_schema
from .spans import Path_, PromptLayout, SchemaLayout, SchemaSpan, Span


@dataclass
class _Item:
    """A piece of the prompt stream: a top-level module reference, free text or role glue."""

    kind: str  # "ref" | "text" | "glue"
    text: str = ""
    path: Path_ = ()
    line: int | None = None


def layout_prompt(
    prompt: Prompt | str | Path,
    schema: SchemaLayout | Schema | str | Path | None,
    tokenizer,
    *,
    max_positions: int | None = None,
) -> PromptLayout:
    """Lay out a prompt against its schema's layout (None for a plain prompt). ``schema`` may
    also be a schema tree, PML text (``str``) or a file (``pathlib.Path``); it is then laid out with ``tokenizer`` (and
    ``max_positions``). ``max_positions``: the model's context; a prompt whose positions reach
    past it is a PMLError naming both numbers."""
    if not isinstance(prompt, Prompt):
        prompt = parse_prompt(prompt)
    tok = as_span_tokenizer(tokenizer)
    if schema is not None and not isinstance(schema, SchemaLayout):
        schema = layout_schema(schema, tok, max_positions=max_positions)
    if prompt.schema is not None:
        if schema is None:
            raise PMLError(f"unknown schema '{prompt.schema}'", prompt.source, prompt.line)
        if schema.name != prompt.schema:
            raise PMLError(f"prompt is for schema '{prompt.schema}', not '{schema.name}'", prompt.source, prompt.line)
    elif schema is not None:
        schema = None  # a plain prompt ignores any schema
    imported: dict[Path_, ModuleRef] = {}
    errors: list[PMLError] = []  # every error of the prompt (imports, argument lengths), raised together
    if schema is not None:
        refs = [c for c in prompt.children if isinstance(c, ModuleRef)] + [
            r for c in prompt.children if isinstance(c, PromptRole) for r in c.children if isinstance(r, ModuleRef)
        ]
        imported = resolve_imports(refs, schema.name, schema.schema.children, prompt.source, errors)
    items = [it for it in _prompt_items(prompt, schema, tok) if it.kind != "ref" or it.path in imported]
    layout = _PromptBuilder(prompt, schema, tok, imported, errors).build(items)
    raise_collected(errors)
    if not layout.spans:
        raise PMLError("empty prompt: it yields no tokens", prompt.source, prompt.line)
    n = max(layout.position_ids) + 1
    if max_positions is not None and n > max_positions:
        raise PMLError(
            f"prompt needs {n} positions (0..{n - 1}), more than the model's limit of {max_positions}",
            prompt.source,
            prompt.line,
        )
    return layout


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
    def __init__(self, prompt: Prompt, schema: SchemaLayout | None, tok: SpanTokenizer, imported: dict,
                 errors: list[PMLError]):
        self.prompt, self.schema, self.tok, self.imported = prompt, schema, tok, imported
        self.errors = errors  # an argument too long is noted here and left out

    def build(self, items: list[_Item]) -> PromptLayout:
        out: list[tuple[tuple, Span]] = []  # (sort key, span)
        included: list[SchemaSpan] = []  # schema spans in this prompt, schema order
        if self.schema is None:
            has_roles = any(isinstance(c, PromptRole) for c in self.prompt.children)
            bos = tuple(self.tok.bos_ids if has_roles else self.tok.plain_bos_ids)
            if bos:
                out.append(((-1, 0), Span("new", "(bos)", bos, tuple(range(len(bos))), "bos")))
            ends = {-1: len(bos)}
        else:
            included = [s for s in self.schema.spans if self._included(s)]
            out += [((s.index, 0), span) for s in included for span in self._schema_span(s)]
            ends = {s.index: s.end for s in included}
        refs = [i for i, it in enumerate(items) if it.kind == "ref"]
        cursors: dict[int, int] = {}  # anchor span index -> next free position after new spans there
        for n, it in enumerate(items):
            if it.kind == "ref" or not it.text:
                continue
            ids = tuple(encode_checked(self.tok, it.text, self.prompt.source, it.line))
            if not ids:
                continue
            anchor, start = self._anchor(items, refs, n, ends)
            start = cursors.get(anchor, start)  # consecutive new spans continue one another
            cursors[anchor] = start + len(ids)
            name = "(text)" if it.kind == "text" else "(role)"
            out.append(((anchor, 1, n), Span("new", name, ids, tuple(range(start, start + len(ids))), it.kind)))
        out.sort(key=lambda kv: kv[0])
        return PromptLayout([s for _, s in out], self.schema, tuple(self.imported))

    def _anchor(self, items: list[_Item], refs: list[int], n: int, ends: dict[int, int]) -> tuple[int, int]:
        """(anchor, start) of new text item n: the index of the schema span it follows in prompt
        order (-1: none), and its first position if no new span was placed there before."""
        before = [r for r in refs if r < n]
        if before and any(r > n for r in refs):  # between two references: after the module before it
            info = self.schema.modules[items[before[-1]].path]
            return info.last_span, info.end
        if before or not refs:  # after the last reference, or no reference: after every included span
            last = max(ends, default=-1)
            return last, ends.get(last, 0)
        first = self._first_span(items[refs[0]].path)  # before the first reference
        last = max((i for i in ends if i < first), default=-1)
        return last, ends.get(last, 0)

    def _first_span(self, path: Path_) -> int:
        """Index of the first schema span inside module ``path`` (one past its last if empty)."""
        k = len(path)
        inside = (s.index for s in self.schema.spans if s.module[:k] == path)
        return next(inside, self.schema.modules[path].last_span + 1)

    def _included(self, s: SchemaSpan) -> bool:
        return all(s.module[: i + 1] in self.imported for i in range(len(s.module)))

    def _schema_span(self, s: SchemaSpan) -> list[Span]:
        if s.kind != "param":
            source = s.kind if s.kind in ("bos", "glue") else ("module" if s.module else "schema")
            kind = "cached" if s.stored else "new"
            return [Span(kind, s.name, s.token_ids, tuple(range(s.start, s.end)), source, s.index)]
        ref = self.imported[s.module]
        arg = ref.args[s.param]
        text = (" " if s.lead_space else "") + arg
        ids = tuple(encode_checked(self.tok, text, self.prompt.source, ref.line)) if arg else ()
        if len(ids) > len(s.token_ids):
            self.errors.append(PMLError(
                f"argument '{s.param}' of module '{'/'.join(s.module)}' is {len(ids)} tokens, "
                f"the parameter allows {len(s.token_ids)}",
                self.prompt.source,
                ref.line,
            ))
            return []
        if not ids:
            return []
        return [Span("new", s.name, ids, tuple(range(s.start, s.start + len(ids))), "argument", s.index)]
