"""What the studio draws, as JSON-ready dicts: a schema's layout and a prompt's spans on the
position axis (``studio.py`` serves them; ``static/studio/`` draws them). Plain functions of a
layout and a way to say where a stored state is; no HTTP here.

Every range is half-open ``[start, end)`` in position IDs. Bars that overlap (nested modules,
union members, which share one range) get different ``lane``s, lowest free lane first, so the
page stacks them without knowing the schema's structure.
"""

from __future__ import annotations

from typing import Callable

from ...layout import PromptLayout, SchemaLayout

MAX_PIECES = 512  # token pieces listed per span for the hover (a long document is cut, with its count)


def lanes(ranges: list[tuple[int, int]]) -> list[int]:
    """A lane per range (in the order given) such that ranges of one lane never overlap."""
    ends: list[list[tuple[int, int]]] = []  # per lane: the ranges placed
    out = []
    for a, b in ranges:
        lane = next((i for i, placed in enumerate(ends) if all(b <= x or a >= y for x, y in placed)), len(ends))
        if lane == len(ends):
            ends.append([])
        ends[lane].append((a, b))
        out.append(lane)
    return out


def pieces(tokenizer, ids) -> list[str]:
    """Each token's text (the hover), at most ``MAX_PIECES``."""
    return [tokenizer.decode([t]) for t in list(ids)[:MAX_PIECES]]


def schema_view(layout: SchemaLayout, tokenizer) -> dict:
    """The layout as bars: ``modules`` (one per module, over its range), ``unions``, ``spans``
    (leaves: anonymous text, role glue, BOS, module text, parameter slots)."""
    mods = sorted(layout.modules.values(), key=lambda m: (m.start, len(m.path)))
    mod_lanes = lanes([(m.start, max(m.end, m.start + 1)) for m in mods])
    modules = [{"name": "/".join(m.path), "start": m.start, "end": m.end, "lane": lane, "cache": m.cache,
                "union": m.union, "line": m.line,
                "tokens": sum(len(s.token_ids) for s in layout.spans if s.module[: len(m.path)] == m.path),
                "params": {n: p.length for n, (_, p) in m.params.items()}}
               for m, lane in zip(mods, mod_lanes)]
    span_lanes = lanes([(s.start, s.end) for s in layout.spans])
    spans = [{"index": s.index, "kind": s.kind, "name": s.name, "module": "/".join(s.module), "start": s.start,
              "end": s.end, "tokens": len(s.token_ids), "stored": s.stored, "param": s.param, "lane": lane,
              "text": "" if s.kind == "param" else tokenizer.decode(list(s.token_ids)),
              "pieces": [] if s.kind == "param" else pieces(tokenizer, s.token_ids)}
             for s, lane in zip(layout.spans, span_lanes)]
    unions = [{"index": u.index, "start": u.start, "end": u.start + u.length, "members": list(u.members),
               "scaffold": u.scaffold, "line": u.line} for u in layout.unions.values()]
    return {"name": layout.name, "end": layout.end, "stored_tokens": layout.stored_tokens,
            "summary": layout.summary(), "modules": modules, "unions": unions, "spans": spans}


def gaps(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Position ranges [a, b) that no range covers, between 0 and the last end."""
    out, at = [], 0
    for a, b in sorted(ranges):
        if a > at:
            out.append((at, a))
        at = max(at, b)
    return out


def why_not_exact(layout: PromptLayout, contexts: dict[int, tuple[int, ...]]) -> str | None:
    """None when the prompt's state equals a plain prefill of its tokens (DESIGN.md §4; the test
    ``assemble`` applies: in KV order, cached spans then new ones, positions run 0..n-1, and each
    cached span was encoded after exactly the cached spans before it), else why not, in words.
    ``contexts``: schema span -> the spans it was encoded after."""
    n = 0
    for s in layout.cached + layout.new:
        pos = list(s.position_ids)
        if pos != list(range(n, n + len(pos))):
            where = f"[{pos[0]}, {pos[-1] + 1})" if pos else "no position"
            return (f"'{s.name}' ({s.kind}) is at positions {where} where a plain prefill has {n}: "
                    "the layout leaves a gap or an overlap there")
        n += len(pos)
    seen: list[int] = []
    for s in layout.cached:
        if contexts.get(s.schema_index) != tuple(seen):
            return (f"'{s.name}' was encoded after other spans than the ones before it here (a union member "
                    "other than the scaffold, or a module whose predecessors are not imported): its states drifted")
        seen.append(s.schema_index)
    return None


def prompt_view(layout: PromptLayout, tokenizer, where: Callable[[int], str]) -> dict:
    """A PML prompt's spans on the axis. ``where(schema_index)``: where a cached span's states
    are ("pool", a store tier's name, or "missing"); new spans are "computed"."""
    spans = []
    for s in layout.spans:
        pos = list(s.position_ids)
        origin = where(s.schema_index) if s.kind == "cached" else "computed"
        spans.append({"name": s.name, "kind": s.kind, "source": s.source, "origin": origin,
                      "start": pos[0] if pos else 0, "end": pos[-1] + 1 if pos else 0, "tokens": len(pos),
                      "text": tokenizer.decode(list(s.token_ids)), "pieces": pieces(tokenizer, s.token_ids)})
    return {"spans": spans, "gaps": gaps([(x["start"], x["end"]) for x in spans if x["tokens"]]),
            "end": max((x["end"] for x in spans), default=0)}


def mark_drifted(view: dict, layout: PromptLayout, exact_head: int, label: str) -> None:
    """Cached spans past the first ``exact_head`` cached tokens (prompt order) get ``label``
    beside their origin (``drift``)."""
    seen = 0
    for s, row in zip(layout.spans, view["spans"]):
        if s.kind == "cached":
            if seen + len(s.token_ids) > exact_head:
                row["drift"] = label
            seen += len(s.token_ids)


def chain_view(ids: list[int], keys: list[str], block: int, tokenizer, where: Callable[[str], str]) -> dict:
    """A token prompt (chat messages, a completion prompt) as prefix blocks: one span per run of
    blocks found in the same place (``where(key)``: "pool", a tier, or "computed"), the rest
    "computed". A prompt reuses at most its first (n - 1) // B blocks: one token always runs."""
    n = len(ids)
    usable = (n - 1) // block
    rows, at = [], 0
    for i, key in enumerate(keys[:usable]):
        origin = where(key)
        if origin == "computed":
            break
        if rows and rows[-1]["origin"] == origin:
            rows[-1]["end"] = at + block
        else:
            rows.append({"origin": origin, "start": at, "end": at + block})
        at += block
    if at < n:
        rows.append({"origin": "computed", "start": at, "end": n})
    spans = [{"name": f"tokens [{r['start']}, {r['end']})", "kind": "new" if r["origin"] == "computed" else "cached",
              "source": "prefix", "origin": r["origin"], "start": r["start"], "end": r["end"],
              "tokens": r["end"] - r["start"], "text": tokenizer.decode(ids[r["start"]:r["end"]]),
              "pieces": pieces(tokenizer, ids[r["start"]:r["end"]])} for r in rows]
    return {"spans": spans, "gaps": [], "end": n}
