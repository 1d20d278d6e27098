"""The package's shape: no import cycles, packages layered, no private member used across modules
(ast only, no imports).

Import graph: every ``import`` / ``from ... import`` in ``promptcache/``, wherever it stands
(a lazy import inside a function still ties two modules), except under ``if TYPE_CHECKING:``.
``from pkg import name`` points at ``pkg.name`` when that is a module, else at ``pkg``.
Private members: an attribute ``x._name`` (not dunder) where ``x`` is not ``self`` or ``cls``,
and ``from m import _name`` of a module in the package. Nothing is allow-listed.

Packages: every module collapses to its unit, the first name under ``promptcache`` (a subpackage
or a top module). ``LAYERS`` ranks the units, lowest first; a unit imports units of its own rank or
below, never above, and no two units import each other through any path. The package face
(``promptcache/__init__``) and entry points (``__main__``) hand names on and are left out.
Inside ``server`` the same rule ranks its subpackages (``SERVER_LAYERS``): ``core`` (the lifecycle
and the worker), the APIs above it, the app and its commands on top. No package holds more than
``MAX_MODULES`` modules, and no function in ``promptcache/`` runs past ``MAX_FUNCTION_LINES``.
``cli`` sits above ``server``: the ``promptcache`` group resolves ``serve`` from ``server/cli.py``;
the server never imports ``cli`` (what both need is ``frontend``).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[1] / "promptcache"
ROOTS = {"promptcache": PKG, "eval": PKG.parent / "eval"}


def modules(root: str = "promptcache") -> dict[str, Path]:
    base = ROOTS[root]
    out = {}
    for f in sorted(base.rglob("*.py")):
        parts = list(f.relative_to(base.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = f
    return out


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(tree: ast.AST):
    """Import nodes outside ``if TYPE_CHECKING:`` blocks (their ``else`` branches count)."""
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            stack.extend(node.orelse)
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        stack.extend(ast.iter_child_nodes(node))


def _resolve(mod: str, is_pkg: bool, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    base = mod.split(".") if is_pkg else mod.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def import_graph() -> dict[str, set[str]]:
    mods = modules()
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for mod, path in mods.items():
        is_pkg = path.name == "__init__.py"
        for node in _imports(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                target = _resolve(mod, is_pkg, node)
                targets = [f"{target}.{a.name}" if f"{target}.{a.name}" in mods else target for a in node.names]
            graph[mod] |= {t for t in targets if t in mods and t != mod}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, on, stack, out, counter = {}, {}, set(), [], [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def private_uses(root: str = "promptcache") -> list[str]:
    """``file:line: what`` for every use of another object's or module's private member."""
    found = []
    for mod, path in modules(root).items():
        tree = ast.parse(path.read_text(encoding="utf-8"))
        rel = path.relative_to(PKG.parent)
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and _private(node.attr):
                owner = node.value
                if not (isinstance(owner, ast.Name) and owner.id in ("self", "cls")):
                    found.append(f"{rel}:{node.lineno}: {ast.unparse(node)}")
            elif isinstance(node, ast.ImportFrom):
                found += [f"{rel}:{node.lineno}: from {'.' * node.level}{node.module or ''} import {a.name}"
                          for a in node.names if _private(a.name)]
    return found


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


LAYERS = [
    {"errors", "fsutil", "jsonsafe", "progress", "tunables", "settings", "bench", "kernels"},  # foundations: no model, no language
    {"pml", "tokens", "layout", "keys", "builder", "models", "store", "artifact"},  # language, models, storage
    {"engine"},
    {"rag", "frontend", "integrations"},  # built on the engine
    {"server"},  # the HTTP app and its ``serve`` command
    {"cli"},  # the ``promptcache`` command group
]
RANK = {unit: rank for rank, units in enumerate(LAYERS) for unit in units}

SERVER_LAYERS = [
    {"core"},  # the worker, the one request lifecycle, errors, limits, metrics, tenancy: no API shape
    {"openai"},  # OpenAI's routes; its preparer, tools and tool-call parser serve the APIs above
    {"anthropic", "studio"},  # Anthropic's Messages API and the studio, on openai's tool machinery
    {"app", "cli", "config", "vllm_flags", "studio_cli", "trim"},  # create_app and the commands that serve it
]
SERVER_RANK = {unit: rank for rank, units in enumerate(SERVER_LAYERS) for unit in units}
MAX_MODULES = 12  # modules in one package folder, __init__ included
MAX_FUNCTION_LINES = 80


def unit(mod: str) -> str:
    return mod.split(".")[1] if "." in mod else mod


def package_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """Unit -> units it imports (another unit only), from the module graph."""
    out: dict[str, set[str]] = {}
    for mod, targets in graph.items():
        if mod == "promptcache" or mod.endswith(".__main__"):
            continue
        out.setdefault(unit(mod), set()).update(unit(t) for t in targets if t != "promptcache")
    return {u: ts - {u} for u, ts in out.items()}


ENGINE_LAYERS = [
    {"decoding"},  # sampling, text, constraints: tokens and logits only
    {"prefill"},  # settings, plans, recompute, the runner and its private buffer, results
    {"schemas"},  # schema encoding, registry, compiled artifacts, PML prompts laid into plans
    {"serving_core"},  # pool, chains, requests, step loop, paged attention, native kernel, Engine
    {"planner"},  # the one planner: every request's PrefillPlan from its prompt spec (data)
    {"core"},  # EngineCore: runner, store, registry, encoder, planner and the serving Engine
    {"facade", "stream"},  # PromptCache (a shell over the core) and GenerationStream on top
]
ENGINE_RANK = {unit: rank for rank, units in enumerate(ENGINE_LAYERS) for unit in units}
SUB_LAYERS = {"server": SERVER_RANK, "engine": ENGINE_RANK}


def sub_unit(mod: str, package: str = "server") -> str | None:
    """``promptcache.server.core.backend`` -> ``core`` (likewise in ``engine``); a top module of the
    package is its own unit; None outside it and for its face (``__init__``) and ``__main__``."""
    parts = mod.split(".")
    if parts[:2] != ["promptcache", package] or len(parts) < 3 or parts[2] == "__main__":
        return None
    return parts[2]


def sub_graph(graph: dict[str, set[str]], package: str = "server") -> dict[str, set[str]]:
    """Units of ``package`` -> its units they import (another unit only)."""
    out: dict[str, set[str]] = {}
    for mod, targets in graph.items():
        u = sub_unit(mod, package)
        if u is not None:
            out.setdefault(u, set()).update(v for t in targets if (v := sub_unit(t, package)) is not None)
    return {u: vs - {u} for u, vs in out.items()}


def package_sizes(base: Path = PKG) -> dict[str, int]:
    """Package folder (relative to promptcache/) -> the modules directly in it."""
    return {str(d.relative_to(base.parent)): len(list(d.glob("*.py")))
            for d in [base, *base.rglob("*")] if d.is_dir() and (d / "__init__.py").exists()}


def long_functions(limit: int = MAX_FUNCTION_LINES) -> list[str]:
    found = []
    for path in sorted(PKG.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno + 1 > limit:
                found.append(f"{path.relative_to(PKG.parent)}:{node.lineno}: {node.name} "
                             f"({node.end_lineno - node.lineno + 1} lines)")
    return found


def test_the_walker_sees_imports_and_cycles():
    g = import_graph()
    assert "promptcache.engine.facade" in g["promptcache.engine"]  # from .facade import PromptCache
    assert "promptcache.engine.schemas.compiled" in g["promptcache.engine.core"]  # from .schemas import compiled
    assert "promptcache.engine.core" not in g["promptcache.engine.schemas.compiled"]  # called with the core, not importing it
    assert "server" in package_graph(g)["cli"]  # the group resolves ``serve`` from server/cli.py
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    src = ast.parse("if TYPE_CHECKING:\n    import x\nelse:\n    import y\ndef f():\n    import z\n")
    assert sorted(a.names[0].name for a in _imports(src)) == ["y", "z"]


def test_no_import_cycles():
    found = cycles(import_graph())
    assert not found, "import cycles: " + "; ".join(" <-> ".join(c) for c in found)


def test_every_unit_has_a_layer():
    missing = sorted(set(package_graph(import_graph())) - set(RANK))
    assert not missing, f"units without a layer in LAYERS: {missing}"


def test_packages_import_only_their_layer_or_below():
    found = [f"{u} (layer {RANK[u]}) imports {v} (layer {RANK[v]})"
             for u, vs in sorted(package_graph(import_graph()).items()) for v in sorted(vs) if RANK[v] > RANK[u]]
    assert not found, "imports running back up the layers:\n" + "\n".join(found)


def test_no_package_cycles():
    found = cycles(package_graph(import_graph()))
    assert not found, "package loops: " + "; ".join(" <-> ".join(c) for c in found)


def test_the_layer_test_sees_a_loop_and_an_upward_import():
    g = {"promptcache.server.cli": {"promptcache.cli.chat"}, "promptcache.cli": {"promptcache.server.cli"}}
    pg = package_graph(g)
    assert pg == {"server": {"cli"}, "cli": {"server"}}
    assert cycles(pg) == [["cli", "server"]]
    assert RANK["cli"] > RANK["server"]  # so server -> cli is the arrow running up


def test_no_private_member_used_across_modules():
    found = private_uses("promptcache") + private_uses("eval")
    assert not found, "private members used from outside their object:\n" + "\n".join(found)


@pytest.mark.parametrize("package", sorted(SUB_LAYERS))
def test_every_subpackage_unit_has_a_layer(package):
    missing = sorted(set(sub_graph(import_graph(), package)) - set(SUB_LAYERS[package]))
    assert not missing, f"{package} units without a layer: {missing}"


@pytest.mark.parametrize("package", sorted(SUB_LAYERS))
def test_subpackages_import_only_their_layer_or_below(package):
    g, rank = sub_graph(import_graph(), package), SUB_LAYERS[package]
    seen = {"server": ("openai", "core"), "engine": ("serving_core", "prefill")}[package]
    assert seen[1] in g[seen[0]]  # the walker sees the subpackages
    found = [f"{package}.{u} (layer {rank[u]}) imports {package}.{v} (layer {rank[v]})"
             for u, vs in sorted(g.items()) for v in sorted(vs) if rank[v] > rank[u]]
    assert not found, f"{package} imports running back up its layers:\n" + "\n".join(found)
    assert not cycles(g), f"{package} subpackage loops: " + "; ".join(" <-> ".join(c) for c in cycles(g))


def test_packages_hold_at_most_twelve_modules():
    sizes = package_sizes()
    assert {"promptcache/server/core", "promptcache/engine/serving_core", "promptcache"} <= set(sizes)  # seen
    big = {name: n for name, n in sizes.items() if n > MAX_MODULES}
    assert not big, f"packages over {MAX_MODULES} modules: {big}"


def test_no_function_runs_past_the_limit():
    found = long_functions()
    assert not found, f"functions over {MAX_FUNCTION_LINES} lines:\n" + "\n".join(found)
    assert long_functions(3), "the walker sees functions"


# -- the engine plans; prompts are data ------------------------------------------------------------
SPEC_FILES = ("engine/serving_core/prompts.py", "rag/prompt.py")
SPEC_FIELD_TYPES = {"str", "int", "float", "bool", "tuple", "Prompt", "PromptLayout"}  # data only (None: a constant)


def spec_fields() -> dict[str, dict[str, set[str]]]:
    """``{class: {field: names in its annotation}}`` of every dataclass in the prompt spec files."""
    out = {}
    for rel in SPEC_FILES:
        for node in ast.parse((PKG / rel).read_text(encoding="utf-8")).body:
            if isinstance(node, ast.ClassDef):
                out[node.name] = {st.target.id: {n.id for n in ast.walk(st.annotation) if isinstance(n, ast.Name)}
                                  for st in node.body if isinstance(st, ast.AnnAssign)}
                out[node.name]["@frozen"] = {"frozen"} if any(
                    isinstance(d, ast.Call) and any(k.arg == "frozen" and getattr(k.value, "value", False)
                                                    for k in d.keywords) for d in node.decorator_list) else set()
    return out


def test_prompt_specs_are_frozen_data_without_engine_objects():
    found = spec_fields()
    assert {"PmlPrompt", "TokenPrompt", "SourcePrompt", "DocumentPrompt"} <= set(found)  # the walker sees them
    assert "str" in found["TokenPrompt"]["namespace"]
    for name, fields in found.items():
        assert fields.pop("@frozen") == {"frozen"}, f"{name} is not a frozen dataclass"
        bad = {f: sorted(types - SPEC_FIELD_TYPES) for f, types in fields.items() if types - SPEC_FIELD_TYPES}
        assert not bad, f"{name} holds more than data (engine, store or PromptCache objects?): {bad}"


def test_prompt_specs_do_not_plan_themselves():
    """Only the planner makes plans: no spec class defines ``plan`` (they called back up through it)."""
    for rel in SPEC_FILES + ("engine/prefill/plan.py",):
        for node in ast.walk(ast.parse((PKG / rel).read_text(encoding="utf-8"))):
            if isinstance(node, ast.ClassDef) and "Prompt" in node.name:
                methods = {f.name for f in node.body if isinstance(f, ast.FunctionDef)}
                assert "plan" not in methods, f"{rel}: {node.name}.plan: specs are data, the planner plans"


def test_the_prompt_cache_stays_at_the_engine_top():
    """No module of the engine but the facade imports it or takes a ``pc`` (the PromptCache), and
    nothing under serving_core imports the planner, the core or the facade (the scheduler is handed
    the planner)."""
    g = import_graph()
    engine = {m for m in g if m.startswith("promptcache.engine.") and m != "promptcache.engine.facade"}
    up = {"promptcache.engine.facade", "promptcache.engine.core", "promptcache.engine.planner"}
    assert not [m for m in engine if "promptcache.engine.facade" in g[m]]
    assert not [m for m in engine if m.startswith("promptcache.engine.serving_core") and g[m] & up]
    takes_pc = []
    for mod in sorted(engine):
        for node in ast.walk(ast.parse(modules()[mod].read_text(encoding="utf-8"))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                takes_pc += [f"{mod}.{node.name}" for a in node.args.args + node.args.kwonlyargs if a.arg == "pc"]
    assert not takes_pc, f"the PromptCache passed below the engine's top: {takes_pc}"
