"""The Makefile's defaults: where ``make train`` and ``make smoke`` write, that ``make smoke``
never deletes what the kit did not write, ``make probe DEVICES=N``, and quiet recipes that
print only the command they run. Each target is run for real with an input the command
refuses at once (a bad key, a missing preset), so nothing trains; the virtualenv is taken as
it is (``-o`` its stamp). Make variables are data: values that make or a shell would run
(``$(shell ...)``, ``$(...)``, backticks, ``;``) reach the command as typed, recorded by a
stand-in interpreter (``PY=``, ``VENV=``) that runs nothing."""

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
MAKE = ["make", "--no-print-directory", "-o", ".venv/.installed-test", "EXTRAS=test"]


# what a shell that typed `make ...` has not set, but a suite started by `make test` inherits:
# the Makefile exports its variables (PRESET=cpu-local, ...) and the parent's command line
USER_VARS = ("MODEL", "PRESET", "NODES", "EP", "STEPS", "OUT", "SET", "ARCH", "TOOL", "IMAGE")
USER_VARS += ("CONTAINER_OUT", "RUN", "DEVICES", "COMPUTE", "COMPILE", "TOP", "PEAK", "DRY_RUN", "WAIT")
USER_VARS += ("TEST_WORKERS", "PYTEST_ARGS", "EXTRAS", "MAKEFLAGS", "MFLAGS", "MAKELEVEL")
SHELL_ENV = {k: v for k, v in os.environ.items() if k not in USER_VARS}


def make(*args: str) -> subprocess.CompletedProcess:
    """``make ARGS`` as typed in a shell, whoever runs the suite."""
    return subprocess.run(
        [*MAKE, *args], cwd=ROOT, capture_output=True, text=True, timeout=300, env=SHELL_ENV
    )


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
    assert all("moe_train.planner" in line for line in loud), loud


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


# what make or a shell would run, each touching the file {f}
INJECTIONS = {
    "make-shell": "x$(shell touch {f})",
    "shell-subst": "x$(touch {f})",
    "backticks": "x`touch {f}`",
    "semicolon": "x;touch {f}",
}
INJECTED = [(var, form) for var in ("SET", "OUT", "MODEL", "PRESET") for form in INJECTIONS]
FLAGS = {"OUT": "--out", "MODEL": "--model", "PRESET": "--preset"}


def fake_python(path: Path, check_rc: int = 0) -> Path:
    """A stand-in interpreter at ``path`` that appends its arguments to calls.jsonl beside it and
    exits 0 (``check_rc`` for ``-c``: the Makefile's XLA:GPU check)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(
        f"#!{sys.executable}\nimport json, sys\n"
        f"open({str(path.parent / 'calls.jsonl')!r}, 'a').write(json.dumps(sys.argv[1:]) + '\\n')\n"
        f"sys.exit({check_rc} if sys.argv[1:2] == ['-c'] else 0)\n"
    )
    path.chmod(0o755)
    return path


def calls(fake: Path) -> list[list[str]]:
    log = fake.parent / "calls.jsonl"
    return [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []


def injected(tmp_path: Path, var: str, form: str) -> tuple[str, Path]:
    """The value, and the file it would create if anything ran it."""
    pwned = tmp_path / "pwned"
    return INJECTIONS[form].format(f=pwned), pwned


def received(argv: list[str], var: str) -> str:
    """What the command got for ``var``: its flag's value (SET: the --set values, space-joined)."""
    if var == "SET":
        return " ".join(value for flag, value in zip(argv, argv[1:]) if flag == "--set")
    return argv[argv.index(FLAGS[var]) + 1]


def submit_dry(tmp_path: Path, var: str, value: str) -> list[str]:
    fake = fake_python(tmp_path / "bin" / "python")
    make("submit", "DRY_RUN=1", f"PY={fake}", f"{var}={value}")
    return calls(fake)[0]


@pytest.mark.parametrize("var,form", INJECTED)
def test_make_submit_runs_nothing_a_variable_holds(tmp_path, var, form):
    value, pwned = injected(tmp_path, var, form)
    submit_dry(tmp_path, var, value)
    assert not pwned.exists()


@pytest.mark.parametrize("var,form", INJECTED)
def test_make_submit_passes_a_variable_as_typed(tmp_path, var, form):
    value, _ = injected(tmp_path, var, form)
    assert received(submit_dry(tmp_path, var, value), var) == value


@pytest.mark.parametrize("form", INJECTIONS)
def test_make_plan_names_the_preset_as_typed_and_runs_none_of_it(tmp_path, form):
    value, pwned = injected(tmp_path, "PRESET", form)
    proc = make("plan", f"PRESET={value}")
    assert proc.returncode == 2 and repr(value) in proc.stderr and not pwned.exists(), proc.stderr


def test_make_prints_the_command_with_the_value_as_typed(tmp_path):
    value, _ = injected(tmp_path, "OUT", "make-shell")
    line = first_line("plan", "PRESET=nope", f"SET=a={value}")
    assert received(shlex.split(line), "SET") == f"a={value}", line


@pytest.mark.parametrize("form", INJECTIONS)
def test_make_help_shows_a_variable_as_typed(tmp_path, form):
    value, pwned = injected(tmp_path, "MODEL", form)
    out = make("help", f"MODEL={value}").stdout
    assert f"MODEL={value} " in out and not pwned.exists(), out


def test_pytest_args_reach_pytest_split_on_spaces_as_typed(tmp_path):
    value, pwned = injected(tmp_path, "PYTEST_ARGS", "semicolon")
    fake = fake_python(tmp_path / "bin" / "python")
    make("test", f"PY={fake}", f"PYTEST_ARGS=-q {value}")
    assert calls(fake)[0][-3:] == ["-q", *value.split()] and not pwned.exists()


@pytest.mark.parametrize("var", ["VENV", "PYTHON", "EXTRAS", "PY"])
@pytest.mark.parametrize("form", ["make-shell", "semicolon"])
def test_a_program_variable_make_would_paste_into_a_command_is_refused_in_one_line(tmp_path, var, form):
    value, pwned = injected(tmp_path, var, form)
    proc = make("help", f"{var}={value}")
    assert proc.returncode == 2 and not proc.stdout and len(proc.stderr.splitlines()) == 1, proc.stderr
    assert f"{var}=" in proc.stderr and not pwned.exists()


def test_submit_says_which_number_of_nodes_is_wrong():
    assert "--nodes must be >= 1, got 0" in make("submit", "NODES=0").stderr


def test_compile_without_preset_says_the_default_has_no_gpu_and_lists_the_gpu_presets():
    err = make("compile", "-o", "xla-gpu").stderr  # -o: as where XLA:GPU's compiler is installed
    assert "PRESET was not given" in err and "PRESET=<a GPU preset>: " in err and "h100-dgx" in err, err


def test_compile_with_a_typed_preset_names_it_as_typed():
    err = make("compile", "-o", "xla-gpu", "PRESET=cpu-local").stderr
    assert "cluster preset 'cpu-local' names no GPU" in err and "not given" not in err, err


def compile_with_fake_venv(tmp_path: Path, check_rc: int, target: str = "compile", extras: str = "test"):
    """``make target`` with a stand-in virtualenv whose XLA:GPU directory holds only make's old
    marker; the Makefile's plugin check (``-c``) exits ``check_rc``. Returns the calls."""
    venv = tmp_path / "venv"
    fake = fake_python(venv / "bin" / "python", check_rc)
    (venv / "xla-gpu").mkdir()
    (venv / "xla-gpu" / ".installed").touch()
    stamp = f"{venv}/.installed-{extras.replace(',', '-')}"
    make(target, f"VENV={venv}", f"EXTRAS={extras}", "-o", stamp)
    return calls(fake)


def pip_installs(argv_list: list[list[str]]) -> list[list[str]]:
    return [argv for argv in argv_list if argv[:3] == ["-m", "pip", "install"]]


def test_compile_reinstalls_xla_gpu_when_the_kit_finds_it_missing_despite_the_marker(tmp_path):
    installs = pip_installs(compile_with_fake_venv(tmp_path, check_rc=1))
    assert len(installs) == 1 and f"{tmp_path}/venv/xla-gpu" in installs[0], installs


def test_compile_installs_nothing_when_the_kit_finds_xla_gpu_usable(tmp_path):
    called = compile_with_fake_venv(tmp_path, check_rc=0)
    assert not pip_installs(called) and ["-m", "moe_train.planner.compile"] == called[-1][:2], called


def test_venv_with_the_compile_extra_reinstalls_xla_gpu_when_the_kit_finds_it_missing(tmp_path):
    installs = pip_installs(compile_with_fake_venv(tmp_path, 1, target="venv", extras="test,compile"))
    assert len(installs) == 1 and f"{tmp_path}/venv/xla-gpu" in installs[0], installs
