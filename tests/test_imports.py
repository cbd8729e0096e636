"""The layout's import rules (docs/design.md, Layout), checked on the source: every ``import``
statement of every module, also those inside functions, followed transitively (importing
``a.b.c`` runs ``a/__init__`` and ``a/b/__init__`` too).

- The training path (the loop and everything it runs) never imports the benchmarks, and the
  trainer core never imports the planner (``python -m moe_train`` hands it its memory check).
- The model and the MoE layer never import the loop, the launcher or the planner.
- ``topology`` never imports the loop or the planner; the planner never imports the launcher
  or the benchmarks, and only its ``compile`` (which lowers the real step) imports the loop.
- An import of the kit inside a function says why on its line (JAX or orbax loaded only where
  needed, an optional dependency, a parameter's default): the rest are at the top.
- No module imports itself through others at import time (module-level statements, outside
  ``if TYPE_CHECKING:``; a package's ``__init__`` naming its own submodules does not count).
- No package imports itself through others: the packages (``moe_train``'s subpackages,
  ``topology``, ``slurm``, ``containers``) form no cycle, so each can be read, tested and
  imported first on its own; ``moe_train.base`` is the floor every one of them may import.
"""

from __future__ import annotations

import ast
import functools
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("moe_train", "topology", "slurm", "containers")
LOOP = ("moe_train.train",)
BENCH = ("moe_train.bench", "moe_train.study")
LAUNCHER = ("slurm",)
PLANNER = ("moe_train.planner",)
PLANNER_COMPILE = ("moe_train.planner.compile",)  # lowers the trainer's real step: imports the loop
TRAINING_PATH = (
    "moe_train.train",
    "moe_train.selftest",
    "moe_train.model",
    "moe_train.moe",
    "moe_train.parallel",
    "moe_train.data",
    "moe_train.eval",
    "moe_train.config",
    "moe_train.telemetry",
    "moe_train.__main__",
)
# the entry point (moe_train.__main__) hands the trainer the planner's memory check
TRAINER_CORE = tuple(m for m in TRAINING_PATH if m != "moe_train.__main__")


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


@functools.cache
def modules() -> dict[str, Path]:
    """Every module of the kit's packages: dotted name -> file."""
    return {_module_name(p): p for pkg in PACKAGES for p in sorted((ROOT / pkg).rglob("*.py"))}


def _import_nodes(path: Path, *, load_time: bool) -> list[ast.Import | ast.ImportFrom]:
    """Every import statement of ``path``; with ``load_time`` only those that run when the
    module is imported: module-level ones (inside ``if``/``try`` too), not those in a function
    or under ``if TYPE_CHECKING:``."""
    tree = ast.parse(path.read_text(), str(path))
    if not load_time:
        return [n for n in ast.walk(tree) if isinstance(n, ast.Import | ast.ImportFrom)]
    out: list[ast.Import | ast.ImportFrom] = []
    todo = list(tree.body)
    while todo:
        node = todo.pop()
        if isinstance(node, ast.Import | ast.ImportFrom):
            out.append(node)
        elif isinstance(node, ast.If) and "TYPE_CHECKING" not in ast.unparse(node.test):
            todo += node.body + node.orelse
        elif isinstance(node, ast.Try):
            todo += node.body + node.orelse + node.finalbody + [s for h in node.handlers for s in h.body]
    return out


def _targets(name: str, path: Path, *, load_time: bool = False) -> set[str]:
    """The kit's modules that ``name``'s import statements name (the nearest existing module);
    ``load_time``: only the statements that run on import, and ``from package import module``
    naming the module alone (``_import_nodes``)."""
    known, out = modules(), set()
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in _import_nodes(path, load_time=load_time):
        if isinstance(node, ast.Import):
            candidates = [a.name for a in node.names]
        else:
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            named = [f"{base}.{a.name}" for a in node.names]
            candidates = [c if c in known else base for c in named] if load_time else [*named, base]
        for c in candidates:
            while c and c not in known:
                c = c.rpartition(".")[0]
            if c:
                out.add(c)
    return out


@functools.cache
def graph() -> dict[str, set[str]]:
    """Direct edges, each module also importing its parent packages."""
    edges = {name: _targets(name, path) for name, path in modules().items()}
    for name, deps in edges.items():
        parts = name.split(".")
        deps.update(".".join(parts[:i]) for i in range(1, len(parts)) if ".".join(parts[:i]) in edges)
        deps.discard(name)
    return edges


@functools.cache
def load_graph() -> dict[str, set[str]]:
    """The edges that run when a module is imported (``_targets(load_time=True)``); a package's
    ``__init__`` naming its own submodules is left out (it re-exports them)."""
    edges = {}
    for name, path in modules().items():
        deps = _targets(name, path, load_time=True) - {name}
        if path.name == "__init__.py":
            deps = {d for d in deps if not d.startswith(name + ".")}
        edges[name] = deps
    return edges


def module_cycles(edges: dict[str, set[str]]) -> list[tuple[str, ...]]:
    """Each group of modules that import one another through ``edges``, sorted."""
    reach = {m: _reach(edges, m) for m in edges}
    groups = {tuple(sorted({m} | {q for q in reach[m] if m in reach.get(q, set())})) for m in edges}
    return sorted(g for g in groups if len(g) > 1)


def reached(name: str) -> set[str]:
    """Every module that importing ``name`` can import."""
    seen, todo = set(), [name]
    while todo:
        for dep in graph()[todo.pop()] - seen:
            seen.add(dep)
            todo.append(dep)
    return seen


def _under(name: str, prefixes: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def violations(sources: tuple[str, ...], forbidden: tuple[str, ...]) -> list[str]:
    """'a -> b' for each module a under ``sources`` that reaches a module b under ``forbidden``."""
    return sorted(
        f"{m} -> {d}" for m in graph() if _under(m, sources) for d in reached(m) if _under(d, forbidden)
    )


def package_of(name: str) -> str | None:
    """The package module ``name`` belongs to: ``moe_train.<sub>`` for a module of a subpackage
    of ``moe_train``, else its top-level package; None for ``moe_train``'s own top-level
    modules (its ``__init__`` and the entry points, which no package imports)."""
    parts = name.split(".")
    if parts[0] != "moe_train":
        return parts[0]
    sub = ".".join(parts[:2])
    return sub if len(parts) > 1 and modules()[sub].name == "__init__.py" else None


def package_graph() -> dict[str, set[str]]:
    """Package -> the other packages its modules import (directly)."""
    out: dict[str, set[str]] = {}
    for name, deps in graph().items():
        if (a := package_of(name)) is not None:
            out.setdefault(a, set()).update(b for d in deps if (b := package_of(d)) not in (None, a))
    return out


def _reach(edges: dict[str, set[str]], start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        for d in edges.get(todo.pop(), set()) - seen:
            seen.add(d)
            todo.append(d)
    return seen


def package_cycles() -> list[tuple[str, ...]]:
    """Each group of packages that import one another (a strongly connected component of
    ``package_graph``, more than one package), its members sorted."""
    edges = package_graph()
    reach = {p: _reach(edges, p) for p in edges}
    groups = {tuple(sorted({p} | {q for q in reach[p] if p in reach.get(q, set())})) for p in edges}
    return sorted(g for g in groups if len(g) > 1)


def _module_edge(a: str, b: str) -> str:
    """One import that makes package ``a`` import package ``b``."""
    return next(
        f"{m} imports {d}"
        for m in sorted(graph())
        if package_of(m) == a
        for d in sorted(graph()[m])
        if package_of(d) == b
    )


def _a_cycle(members: tuple[str, ...]) -> str:
    """A shortest import cycle through ``members[0]``, each step with one module edge that
    makes it: what to look at when the test fails."""
    edges, start = package_graph(), members[0]
    paths, todo = {start: [start]}, [start]
    while todo:
        p = todo.pop(0)
        for q in sorted(edges[p]):
            if q == start:
                hops = [*paths[p], start]
                return "; ".join(_module_edge(a, b) for a, b in zip(hops, hops[1:]))
            if q in members and q not in paths:
                paths[q] = [*paths[p], q]
                todo.append(q)
    return ", ".join(members)


def test_the_graph_sees_the_packages():
    assert {"moe_train.train.loop", "moe_train.model.transformer", "moe_train.planner.ep_plan"} <= set(
        graph()
    )
    assert "moe_train.model.transformer" in reached("moe_train.train.loop")


def test_the_training_path_never_imports_the_benchmarks():
    assert violations(TRAINING_PATH, BENCH) == []


def test_the_trainer_core_never_imports_the_planner():
    assert violations(TRAINER_CORE, PLANNER) == []


def test_model_and_moe_never_import_the_loop_launcher_or_planner():
    assert violations(("moe_train.model", "moe_train.moe"), LOOP + LAUNCHER + PLANNER) == []


def test_topology_never_imports_the_loop_or_the_planner():
    assert violations(("topology",), LOOP + PLANNER) == []


def test_the_planner_never_imports_the_launcher_or_the_benchmarks():
    assert violations(PLANNER, LAUNCHER + BENCH) == []


def test_only_the_planners_compile_imports_the_loop():
    outside = [m for m in graph() if _under(m, PLANNER) and not _under(m, PLANNER_COMPILE)]
    assert sorted(f"{m} -> {d}" for m in outside for d in reached(m) if _under(d, LOOP)) == []


def test_a_forbidden_edge_is_found(monkeypatch):
    """The check can fail: a lazy import inside a function counts."""
    edges = {k: set(v) for k, v in graph().items()}
    edges["moe_train.moe.router"].add("moe_train.train.loop")
    monkeypatch.setattr(sys.modules[__name__], "graph", lambda: edges)
    assert "moe_train.moe.router -> moe_train.train.loop" in violations(("moe_train.moe",), LOOP)


def test_no_package_imports_itself_through_others():
    cycles = package_cycles()
    assert cycles == [], "; ".join(_a_cycle(c) for c in cycles)


def test_a_package_cycle_is_found(monkeypatch):
    """The check can fail: the config importing the loop (lazily, in a function) closes a cycle."""
    edges = {k: set(v) for k, v in graph().items()}
    edges["moe_train.config.checks"].add("moe_train.train.loop")
    monkeypatch.setattr(sys.modules[__name__], "graph", lambda: edges)
    assert any({"moe_train.config", "moe_train.train"} <= set(c) for c in package_cycles())


def test_no_module_imports_itself_at_import_time():
    assert module_cycles(load_graph()) == []


def test_a_module_cycle_is_found():
    """The check can fail: the search importing the decision at module level closes a cycle."""
    edges = {k: set(v) for k, v in load_graph().items()}
    edges["moe_train.planner.search"].add("moe_train.planner.decide")
    assert ("moe_train.planner.decide", "moe_train.planner.search") in [
        tuple(c for c in g if c.endswith(("decide", "search"))) for g in module_cycles(edges)
    ]


def unexplained_local_imports(path: Path) -> list[str]:
    """'file:line' of each import of the kit inside a function of ``path`` with no comment on
    its line saying why it is there and not at the top."""
    text = path.read_text()
    lines, out = text.splitlines(), []
    for func in ast.walk(ast.parse(text, str(path))):
        if not isinstance(func, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        for node in ast.walk(func):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = ["moe_train"] if node.level else [node.module or ""]
            else:
                continue
            kit = any(n.split(".")[0] in PACKAGES for n in names)
            if kit and "#" not in lines[node.lineno - 1]:
                out.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    return out


def test_a_local_import_of_the_kit_says_why():
    assert [x for p in modules().values() for x in unexplained_local_imports(p)] == []


def test_an_unexplained_local_import_is_found(tmp_path, monkeypatch):
    """The check can fail: a bare import of the kit in a function is named."""
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    path = tmp_path / "m.py"
    path.write_text("def f():\n    from topology import presets\n    from jax import numpy  # not the kit\n")
    assert unexplained_local_imports(path) == ["m.py:2"]


def test_the_base_imports_no_package_of_the_kit():
    assert package_graph()["moe_train.base"] == set()


def test_starting_the_loop_loads_no_benchmark_module():
    code = (
        "import sys, moe_train.train.loop, moe_train.selftest; "
        "print([m for m in sys.modules if m.startswith('moe_train.bench')])"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert out.stdout.strip() == "[]"


@pytest.mark.parametrize(
    "module",
    [
        "moe_train.parallel.jobplan",
        "moe_train.config.checks",
        "moe_train.planner.cost",
        "moe_train.data.packing",
        "moe_train.model.flops",
        "moe_train.moe.routings",
        "moe_train.checkpoints.checkpoint",
        "topology.device_mesh",
    ],
)
def test_a_low_level_module_imports_first(module):
    """No package cycle breaks a fresh interpreter whose first import is this module."""
    subprocess.run([sys.executable, "-c", f"import {module}"], check=True, cwd=ROOT)


@pytest.mark.parametrize("package", sorted(p.parent.name for p in (ROOT / "moe_train").glob("*/__init__.py")))
def test_each_subpackage_says_what_it_may_import(package):
    doc = ast.get_docstring(ast.parse((ROOT / "moe_train" / package / "__init__.py").read_text()))
    assert doc and "May import" in doc, f"moe_train/{package}/__init__.py"


def test_the_top_level_holds_entry_points_only():
    top = sorted(p.name for p in (ROOT / "moe_train").glob("*.py"))
    assert top == ["__init__.py", "__main__.py", "score.py", "study.py"]
