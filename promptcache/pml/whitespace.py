"""The PML whitespace rule, applied to parsed (or builder-made) trees in place. No torch.

One rule for schemas, prompts and ``src`` files:
  * Inside a text run, text is kept as written (newlines included), except that a run that
    starts on a new line (pretty-printed XML) loses the indentation common to its lines, so the
    layout's indentation does not reach the model; relative indentation survives. A run that
    starts right after its tag, ``src`` files and plain-text prompts are kept verbatim.
  * At the edges of runs, whitespace is a separator: a run's leading and trailing whitespace is
    removed, and when any whitespace stood between two spans (at the end of the first, at the
    start of the second, or as a whitespace-only run between them, across tags) the second span
    starts with exactly one space. A parameter slot preceded by whitespace gives its argument
    (and placeholder) that leading space.
  * No separator is added at the start of a schema, at the start of a role's content (the chat
    template places its own), or at the start of a prompt without a schema.
"""

from __future__ import annotations

from .nodes import Module, ModuleRef, Parameter, PromptRole, Role, Text, Union


def dedent_text(text: str) -> str:
    """Remove the indentation common to a text run's lines when the run starts on a new line
    (pretty-printed XML); a run that starts right after its tag is kept as written."""
    lines = text.split("\n")
    if lines[0].strip() or len(lines) == 1:
        return text
    indents = [len(ln) - len(ln.lstrip(" \t")) for ln in lines if ln.strip()]
    if not indents:
        return text
    k = min(indents)
    return "\n".join(ln[k:] if ln.strip() else "" for ln in lines)


class _WS:
    def __init__(self, at_start: bool):
        self.pending = False  # whitespace seen since the last span
        self.at_start = at_start  # no separator before the next span

    def copy(self) -> "_WS":
        c = _WS(self.at_start)
        c.pending = self.pending
        return c


def normalize_whitespace(children: list, at_start: bool) -> None:
    """Apply the whitespace rule in place (module docstring); drops whitespace-only texts."""
    _norm(children, _WS(at_start))


def _norm(children: list, st: _WS) -> None:
    kept = []
    for c in children:
        if isinstance(c, Text):
            raw = c.text
            core = (raw if c.verbatim else dedent_text(raw)).strip()
            if not core:
                st.pending = st.pending or bool(raw)
                continue
            lead = (st.pending or raw[0].isspace()) and not st.at_start
            c.text = (" " if lead else "") + core
            st.pending, st.at_start = raw[-1].isspace(), False
        elif isinstance(c, Parameter):
            c.lead_space = st.pending and not st.at_start
            st.pending = st.at_start = False
        elif isinstance(c, (Module, ModuleRef)):
            _norm(c.children, st)
        elif isinstance(c, Union):
            entry, after = st, []
            for m in c.members:
                s = entry.copy()
                _norm(m.children, s)
                after.append(s)
            # after the union: separated if any member ended in whitespace
            st.pending = entry.pending and all(s.at_start for s in after) or any(s.pending for s in after)
            st.at_start = all(s.at_start for s in after)
        elif isinstance(c, (Role, PromptRole)):
            inner = _WS(at_start=True)
            _norm(c.children, inner)
            st.pending, st.at_start = False, False
        kept.append(c)
    children[:] = kept
