"""One notation (``moe_train.base.notation``): every shape suffix in the kit's packages uses the
table's letters, the table in the module's docstring and ``LETTERS`` agree, and no module keeps
a legend of its own ("Shape key:", "Letter key:").

A shape suffix: an otherwise lowercase identifier (names, arguments, attributes, keyword
arguments, function and class names, import aliases) ending in ``_`` and 1-6 uppercase axis
letters, digits allowed among them (``x_TH``, ``tokens_BS1``, ``part_R1H``, ``j_1K``; digits
are sizes or stage numbers, never letters). ALL_CAPS names (``MAX_PADDING``, ``P_BE``) have an
uppercase stem and are constants or formula symbols, not suffixed arrays: never matched.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from moe_train.base import notation
from moe_train.base.notation import LETTERS

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("moe_train", "topology", "slurm", "containers")
# otherwise lowercase, then _ and the suffix: 1-6 letters, digits anywhere among them
SUFFIX = re.compile(r"^_*[a-z][a-z0-9]*(?:_[a-z0-9]+)*_(?=(?:[0-9]*[A-Z]){1,6}[0-9]*$)([A-Z0-9]+)$")
# endings that look like a shape suffix and are not one (a unit, an acronym), so no letter
# in them is an axis. None is needed today; add one here with the reason, never a letter.
NOT_SHAPES: dict[str, str] = {}
LEGENDS = re.compile(r"\b(Shape key|Letter key)\b")


def _sources() -> list[Path]:
    return [p for pkg in PACKAGES for p in sorted((ROOT / pkg).rglob("*.py"))]


def _names(node: ast.AST) -> list[str]:
    if isinstance(node, ast.Name):
        return [node.id]
    if isinstance(node, ast.arg):
        return [node.arg]
    if isinstance(node, ast.Attribute):
        return [node.attr]
    if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
        return [node.name]
    if isinstance(node, ast.keyword) and node.arg:
        return [node.arg]
    if isinstance(node, ast.alias):
        return [(node.asname or node.name).rpartition(".")[2]]
    if isinstance(node, ast.Global | ast.Nonlocal):
        return list(node.names)
    return []


def suffixed(source: str) -> list[tuple[int, str, str]]:
    """(line, identifier, suffix) of every shape-suffixed identifier in ``source``."""
    out = []
    for node in ast.walk(ast.parse(source)):
        for name in _names(node):
            m = SUFFIX.match(name)
            if m and m.group(1) not in NOT_SHAPES:
                out.append((getattr(node, "lineno", 0), name, m.group(1)))
    return out


def unknown_letters(source: str) -> list[tuple[int, str, str]]:
    """(line, identifier, letters not in LETTERS) for each suffix using a letter the table lacks."""
    out = []
    for line, name, suffix in suffixed(source):
        bad = "".join(sorted({c for c in suffix if c.isalpha() and c not in LETTERS}))
        if bad:
            out.append((line, name, bad))
    return out


def _table() -> dict[str, str]:
    """The docstring's table: ``  X  meaning`` lines, continuation lines indented further."""
    table: dict[str, str] = {}
    last = None
    for line in (notation.__doc__ or "").splitlines():
        m = re.match(r"^  ([A-Z])  (\S.*)$", line)
        if m:
            last = m.group(1)
            assert last not in table, f"letter {last} twice in the table"
            table[last] = m.group(2)
        elif last and re.match(r"^     \S", line):
            table[last] += " " + line.strip()
        else:
            last = None
    return table


def test_the_docstring_table_and_letters_agree():
    assert _table() == LETTERS


def test_every_shape_suffix_uses_the_tables_letters():
    bad = [
        f"{path.relative_to(ROOT)}:{line}: {name} ({letters} not in moe_train.base.notation)"
        for path in _sources()
        for line, name, letters in unknown_letters(path.read_text())
    ]
    assert not bad, "\n".join(bad)


def test_no_module_keeps_a_legend_of_its_own():
    bad = [str(p.relative_to(ROOT)) for p in _sources() if LEGENDS.search(p.read_text())]
    assert not bad, "point these at moe_train.base.notation: " + ", ".join(bad)


def test_every_letter_of_the_table_is_used():
    used = {c for p in _sources() for _, _, s in suffixed(p.read_text()) for c in s if c.isalpha()}
    assert sorted(set(LETTERS) - used) == []


@pytest.mark.parametrize(
    "source,found",
    [
        ("x_QH = 1", [(1, "x_QH", "Q")]),  # Q is unassigned
        ("def f(y_TH, *, w_R1Q): return y_TH.at_Q", [(1, "w_R1Q", "Q"), (1, "at_Q", "Q")]),
        ("MAX_Q = 1\nP_QE = 2\nx_TH = 3\nsm_90 = 4", []),  # constants, digits only, known letters
    ],
)
def test_the_check_finds_unknown_letters(source, found):
    assert sorted(unknown_letters(source)) == sorted(found)
