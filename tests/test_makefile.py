"""The Makefile's defaults: where ``make train`` and ``make smoke`` write, that ``make smoke``
never deletes what the kit did not write, ``make probe DEVICES=N``, and quiet recipes that
print only the command they run. Each target is run for real with an input the command
refuses at once (a bad key, a missing preset), so nothing trains; the virtualenv is taken as
it is (``-o`` its stamp)."""

import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
MAKE = ["make", "--no-print-directory", "-o", ".venv/.installed-test", "EXTRAS=test"]


def make(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([*MAKE, *args], cwd=ROOT, capture_output=True, text=True, timeout=300)


def first_line(*args: str) -> str:
    return make(*args).stdout.splitlines()[0]


def test_train_writes_runs_model_by_default():
    assert "--out runs/small" in first_line("train", "MODEL=small", "SET=moe.nope=1")


def test_train_names_a_toml_model_s_run_after_its_file():
    assert "--out runs/mine " in first_line("train", "MODEL=/nonexistent/mine.toml") + " "


def test_train_writes_the_given_out(tmp_path):
    assert f"--out {tmp_path}/r" in first_line("train", "MODEL=small", f"OUT={tmp_path}/r", "SET=moe.nope=1")


def test_smoke_starts_fresh_in_runs_smoke():
    assert "--out runs/smoke --fresh" in first_line("smoke", "SET=moe.nope=1")


def test_smoke_refuses_a_directory_the_kit_did_not_write(tmp_path):
    (tmp_path / "data.bin").write_text("mine")
    proc = make("smoke", f"OUT={tmp_path}")
    assert "--fresh" in proc.stderr and (tmp_path / "data.bin").read_text() == "mine", proc.stderr


def test_probe_passes_devices():
    assert "--devices 3" in first_line("probe", "PRESET=nope", "DEVICES=3")


def test_a_recipe_prints_the_command_not_its_shell_plumbing():
    assert re.fullmatch(
        r"\S*python\S* -m moe_train --preset small --out runs/small --set moe.nope=1",
        first_line("train", "MODEL=small", "SET=moe.nope=1"),
    )


def test_every_recipe_line_is_quiet_but_make_plan_s():
    lines = (ROOT / "Makefile").read_text().splitlines()
    loud = [
        line
        for before, line in zip([""] + lines, lines)  # not a continued line
        if line.startswith("\t") and not line.startswith("\t@") and not before.endswith("\\")
    ]
    assert all("slurm.show" in line for line in loud), loud


def test_clean_leaves_the_runs_directory():
    recipe = subprocess.run(
        ["make", "--no-print-directory", "-n", "clean"], cwd=ROOT, capture_output=True, text=True, timeout=60
    ).stdout
    assert "rm -rf" in recipe and ".venv" in recipe and not re.search(r"\bruns\b", recipe)


def test_lint_and_format_install_the_lint_extra_then_run_ruff_and_pyright():
    recipe = make("-n", "-B", "lint", "format").stdout  # -B: as from a clone without the extra
    assert "-e '.[lint]'" in recipe, recipe
    commands = ("ruff check .", "ruff format --check .", "pyright", "ruff format .", "ruff check --fix .")
    for command in commands:
        assert f"/bin/{command}\n" in recipe, (command, recipe)
