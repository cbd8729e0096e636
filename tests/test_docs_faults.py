"""docs/faults.md: every fault row names a test, and every test it names exists."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "faults.md"
REF = re.compile(r"`((test_\w+\.py)?::(\w+))`")


def _fault_rows() -> list[str]:
    """The table rows of the fault tables (four columns, the last one the tests)."""
    rows = [line for line in DOC.read_text().splitlines() if line.startswith("| ")]
    return [r for r in rows if r.count(" | ") == 3 and not r.startswith(("| fault", "| code"))]


def _references() -> list[tuple[str, str]]:
    """(test file, test function) of every reference, ``::name`` meaning the file before."""
    out, last = [], None
    for match in REF.finditer(DOC.read_text()):
        last = match.group(2) or last
        out.append((last, match.group(3)))
    return out


def test_every_fault_row_names_a_test():
    bare = [r for r in _fault_rows() if not REF.search(r)]
    assert bare == []


def test_no_table_waits_to_be_filled_in():
    assert "to be filled in" not in DOC.read_text()


def test_every_named_test_exists():
    missing = [
        (f, name)
        for f, name in _references()
        if not re.search(rf"^def {name}\(", (ROOT / "tests" / f).read_text(), re.M)
    ]
    assert missing == []
