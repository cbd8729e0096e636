"""docs/architecture.md: every path it names exists, every ``path::name`` is defined there,
and its import layers agree with the imports (no package imports one of a later layer)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from test_imports import package_graph

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "architecture.md"
CODE = re.compile(r"`([^`\s]+)`")
PATH = re.compile(r"(?:[\w.-]+/)+[\w.-]*")  # a/b.py, a/b/: a bare file name is no path
LAYER_ROW = re.compile(r"^\| (\d+) \| (.+?) \|")


def _code_spans() -> list[str]:
    return CODE.findall(DOC.read_text())


def _paths() -> set[str]:
    """The repository paths the page names: ``a/b.py``, ``a/b/``, ``a/b.py::name``."""
    return {span.split("::")[0] for span in _code_spans() if PATH.fullmatch(span.split("::")[0])}


def _defines(path: Path, dotted: str) -> bool:
    """Whether ``path`` defines ``dotted``: a top-level function, class or name, or
    ``Class.attribute`` (a method or a class-level name)."""
    scope: list[ast.stmt] = ast.parse(path.read_text()).body
    for part in dotted.split("."):
        found = next((node for node in scope if part in _names(node)), None)
        if found is None:
            return False
        scope = found.body if isinstance(found, ast.ClassDef) else []
    return True


def _names(node: ast.stmt) -> set[str]:
    if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
        return {node.name}
    if isinstance(node, ast.Assign):
        return {t.id for t in node.targets if isinstance(t, ast.Name)}
    if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
        return {node.target.id}
    return set()


def _layers() -> list[set[str]]:
    """The packages of each row of the page's layer table, top row first, as dotted names."""
    rows = [LAYER_ROW.match(line) for line in DOC.read_text().splitlines()]
    return [{p.strip("/").replace("/", ".") for p in CODE.findall(m[2])} for m in rows if m]


def test_the_page_names_paths():
    assert len(_paths()) > 40


def test_every_path_exists():
    assert sorted(p for p in _paths() if not (ROOT / p).exists()) == []


def test_every_named_function_or_class_is_defined_where_the_page_says():
    refs = [span.split("::") for span in _code_spans() if "::" in span]
    assert len(refs) > 30
    assert sorted(f"{p}::{n}" for p, n in refs if not _defines(ROOT / p, n)) == []


def test_every_test_named_is_one_of_the_import_rules():
    named = {span for span in _code_spans() if span.startswith("test_")}
    source = (ROOT / "tests" / "test_imports.py").read_text()
    assert len(named) >= 5
    assert sorted(n for n in named if f"def {n}(" not in source) == []


def test_the_layers_hold_every_package_once():
    layers = _layers()
    named = [p for layer in layers for p in layer]
    assert len(named) == len(set(named))
    assert set(named) == set(package_graph())


def test_no_package_imports_a_later_layer():
    layer_of = {p: i for i, layer in enumerate(_layers()) for p in layer}
    edges = package_graph()
    later = sorted(f"{a} -> {b}" for a, deps in edges.items() for b in deps if layer_of[b] > layer_of[a])
    assert later == []
