"""What the repository ships names no machine's own paths: no tracked file outside tests/ holds
an absolute path into someone's home, a work area or a shared mount (``/home/...``,
``/work/...``, ``../shared``), which a user's clone does not have. A reference document is
cited by name, not by where it lay on the machine that wrote the file.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
MACHINE_PATH = re.compile(rb"(?<![\w.])(/home/|/work/|/Users/|/root/|\.\./shared\b)")


def shipped() -> list[str]:
    """Tracked files outside tests/ (git's own list: what a clone gets)."""
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout: the shipped files are git's tracked files")
    out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    return [f for f in out.decode().split("\0") if f and not f.startswith("tests/")]


def with_machine_paths() -> dict[str, list[str]]:
    """File -> the machine paths it holds (each match with a little context)."""
    found = {}
    for name in shipped():
        path = ROOT / name
        if not path.is_file():
            continue
        data = path.read_bytes()
        hits = [data[max(m.start() - 20, 0) : m.end() + 30] for m in MACHINE_PATH.finditer(data)]
        if hits:
            found[name] = [h.decode(errors="replace") for h in hits]
    return found


def test_no_shipped_file_names_a_machine_path():
    assert with_machine_paths() == {}


def test_the_pattern_finds_machine_paths_and_not_look_alikes():
    assert MACHINE_PATH.search(b"see /work/shared/reference/x.md")
    assert MACHINE_PATH.search(b"ln -s ../shared/data")
    assert not MACHINE_PATH.search(b"runs/work/ and moe_train/home/ and /tmp/smoke")
