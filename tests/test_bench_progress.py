"""``python -m moe_train.bench`` is never silent: each section says when it starts, beats
every 10 s and says when it is done; the overlap section prints each row as it finishes,
before the results table."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def lines(tmp_path_factory) -> list[str]:
    out = tmp_path_factory.mktemp("bench")
    proc = subprocess.run(
        [sys.executable, "-m", "moe_train.bench", "--quick", "--only", "overlap", "--out", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout.splitlines()


@pytest.mark.slow
def test_the_section_says_when_it_starts(lines):
    assert lines[0] == "running benchmark section overlap ..."


@pytest.mark.slow
def test_the_section_says_how_long_it_took(lines):
    assert any(s.startswith("running benchmark section overlap: done in ") for s in lines)


@pytest.mark.slow
def test_every_row_is_printed_before_the_table(lines):
    table = next(i for i, s in enumerate(lines) if s.startswith("# moe_train benchmarks"))
    rows = [i for i, s in enumerate(lines) if s.startswith("  overlap: dispatcher ")]
    assert len(rows) == 15 and max(rows) < table, lines
