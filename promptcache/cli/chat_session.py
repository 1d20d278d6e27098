"""A terminal chat's state and turns (``ChatSession``); ``chat.py`` is the command around it.

Each turn is a PML prompt: the imported modules (``/use``; default: the top-level modules outside
unions and without parameters, so no union member speaks unless picked), then the conversation
so far, then the new user message. A parameter takes the argument given with ``/use NAME
p=value``, or none (it adds no tokens): never its scaffold, which is a placeholder for encoding,
and which the model would otherwise answer as the user's premise ("your five days").

How a turn is served:
  * while the schema's stored states cover more of the turn than stored blocks do (the first
    turn of a schema chat, or the first after ``/use``), through the schema: imported modules come from their stored states (``pc.generate``), so turn 1 already
    reports cached tokens. Such a state is exact only when the modules were encoded in the context
    they now stand in (the stats line says ``exact`` or ``approximate (recompute r)``). The
    turn's tokens are then run once more in prompt order to store exact prefix blocks, after the
    answer is shown (off the next turn's time to first token);
  * otherwise as token ids (positions 0..n-1) through the engine's prefix chains: they reuse the
    blocks of earlier turns, prompt and answer, shared in the KV pool (exact), and only what is
    new runs, as a server's chat turns do.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass, field
from xml.sax.saxutils import escape

from ..fsutil import atomic_write_text
from ..pml import PMLError

HELP = """commands:
  /modules         list the schema's modules and unions (* imported)
  /use NAME [p=value ...] ...
                   import these modules instead (a union member picks that union's text);
                   p=value fills the module's parameter p (one not given is left out;
                   quote a value with spaces: travelers="two adults")
  /clear           forget the conversation (the modules stay)
  /save FILE       write the conversation as JSON
  /help            this list
  /quit            end (or Ctrl-D)"""


def _top_level(layout):
    """(name, module) of the top-level modules outside unions, in schema order."""
    members = {m for u in layout.unions.values() for m in u.members}
    return [(n, m) for n, m in (("/".join(m.path), m) for m in layout.modules.values() if len(m.path) == 1)
            if n not in members]


def default_imports(layout) -> list[str]:
    """Top-level modules outside unions and without parameters, in schema order (union members
    and modules with parameters are imported with /use)."""
    return [n for n, m in _top_level(layout) if not m.params]


def parse_use(args: list[str]) -> list[tuple[str, dict[str, str]]]:
    """``["trip", "days=3", "food"]`` -> ``[("trip", {"days": "3"}), ("food", {})]``: a ``p=value``
    word fills a parameter of the module named before it."""
    out: list[tuple[str, dict[str, str]]] = []
    for word in args:
        if "=" in word and out:
            p, value = word.split("=", 1)
            out[-1][1][p] = value
        elif "=" in word:
            raise ValueError(f"{word!r}: name the module first (/use NAME {word})")
        else:
            out.append((word, {}))
    return out


def left_out(layout, imports: list[str]) -> list[str]:
    """Top-level modules with parameters not imported, as "trip (days, travelers)"."""
    return [f"{n} ({', '.join(m.params)})" for n, m in _top_level(layout) if m.params and n not in imports]


def import_tag(layout, name: str, arguments: dict[str, str] | None = None) -> str:
    """``<name p="value" .../>``: a module import; a parameter without an argument is left empty (no
    tokens), never given its scaffold. An argument for no parameter of the module is a ValueError."""
    module = layout.modules.get(tuple(name.split("/")))
    params = list(module.params) if module is not None else []
    arguments = arguments or {}
    unknown = [p for p in arguments if p not in params]
    if unknown:
        raise ValueError(f"module '{name}' has no parameter {', '.join(unknown)} "
                         f"(its parameters: {', '.join(params) or 'none'})")
    args = "".join(f' {p}="{escape(arguments.get(p, ""), {chr(34): "&quot;"})}"' for p in params)
    return f"<{name}{args}/>"


def turn_prompt(schema: str | None, imports: list[str], history: list[tuple[str, str]], user: str) -> str:
    """The PML prompt of one turn; ``imports`` are import tags (``import_tag``)."""
    roles = "".join(f"<user>{escape(u)}</user><assistant>{escape(a)}</assistant>" for u, a in history)
    body = "".join(imports) + roles + f"<user>{escape(user)}</user>"
    return f'<prompt schema="{schema}">{body}</prompt>' if schema else f"<prompt>{body}</prompt>"


@dataclass
class ChatSession:
    pc: object
    engine: object  # engine.core.Engine: the serving core every turn runs on
    layout: object | None  # the schema's layout (None: a plain chat)
    imports: list[str] = field(default_factory=list)  # module names
    arguments: dict[str, dict[str, str]] = field(default_factory=dict)  # module -> parameter -> argument
    history: list[tuple[str, str]] = field(default_factory=list)

    def command(self, line: str) -> str | None:
        """Run a /command; returns what to print (None: not a command, send it to the model)."""
        if not line.startswith("/"):
            return None
        try:
            name, *args = shlex.split(line)  # quotes keep a spaced argument whole: days="two weeks"
        except ValueError as e:
            return f"cannot read the command: {e}"
        handler = {"/help": self._help, "/modules": self._modules, "/use": self._use, "/clear": self._clear,
                   "/save": self._save}.get(name)
        if handler is None:
            return f"unknown command {name}; /help lists them"
        return handler(args)

    def answer(self, user: str, max_new_tokens: int):
        """One turn: the Generation (and its stats line); the history grows by it."""
        name = self.layout.name if self.layout is not None else None
        tags = [import_tag(self.layout, n, self.arguments.get(n)) for n in self.imports] \
            if self.layout is not None else []
        text = turn_prompt(name, tags, self.history, user)
        layout = self.pc.layout(text)
        ids, ns = list(layout.token_ids), self.pc.config.namespace
        stored = sum(len(s.token_ids) for s in layout.spans if s.kind == "cached")  # from module states
        via_schema = self.layout is not None and stored > self.engine.matched_tokens(ids, ns)
        out = self.pc.generate(text if via_schema else ids, max_new_tokens=max_new_tokens)
        self.history.append((user, out.text.strip()))
        return out, via_schema, ids

    def store_blocks(self, ids: list[int]) -> None:
        """Compute a schema-served turn's tokens in prompt order once more, so their exact prefix
        blocks are shared in the pool for the turns after it."""
        self.pc.generate(ids, max_new_tokens=0)

    def stats(self, out) -> str:
        r = self.pc.config.recompute.fraction
        quality = "exact" if out.exact else f"approximate (recompute {r if isinstance(r, str) else format(r, 'g')})"
        total = out.cached_tokens + out.new_tokens
        return (f"[TTFT {out.ttft * 1e3:.1f} ms | cached {out.cached_tokens} of {total} tokens | "
                f"new {out.new_tokens} tokens | {quality}]")

    # -- commands ---------------------------------------------------------------------------------
    def _help(self, args) -> str:
        return HELP

    def _modules(self, args) -> str:
        if self.layout is None:
            return "no schema (start with --schema FILE)"
        members = {m: u for u in self.layout.unions.values() for m in u.members}
        rows = []
        for m in self.layout.modules.values():
            name = "/".join(m.path)
            union = f" (union member; alternatives: {', '.join(x for x in members[name].members if x != name)})" \
                if name in members else ""
            rows.append(f"{'*' if name in self.imports else ' '} {name}{union}")
        return "\n".join(rows)

    def _use(self, args) -> str:
        if self.layout is None:
            return "no schema (start with --schema FILE)"
        known = {m.path[0] for m in self.layout.modules.values() if len(m.path) == 1}  # nested ones: inside their parent
        try:
            chosen = parse_use(args)
            for name, arguments in chosen:
                if name in known:
                    import_tag(self.layout, name, arguments)  # an unknown parameter is refused here
        except ValueError as e:
            return str(e)
        unknown = [n for n, _ in chosen if n not in known]
        if not chosen or unknown:
            return f"unknown module(s) {', '.join(unknown) or '(none given)'}; /modules lists them"
        tags = [import_tag(self.layout, n, a) for n, a in chosen]
        try:  # an argument longer than its parameter is refused now, not at the next message
            self.pc.layout(turn_prompt(self.layout.name, tags, [], "?"))
        except PMLError as e:
            return e.reason
        self.imports, self.arguments = [n for n, _ in chosen], {n: a for n, a in chosen if a}
        return f"importing {', '.join(self.imports)}"

    def _clear(self, args) -> str:
        self.history.clear()
        return "conversation cleared"

    def _save(self, args) -> str:
        import json

        if len(args) != 1:
            return "usage: /save FILE"
        turns = [{"user": u, "assistant": a} for u, a in self.history]
        atomic_write_text(args[0], json.dumps({"imports": self.imports, "turns": turns}, indent=2) + "\n")
        return f"saved {len(turns)} turns to {args[0]}"
