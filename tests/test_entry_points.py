"""Every ``python -m moe_train...`` command run by a Python without the kit's dependencies says
which module is missing and the command that works (one line, exit 2); the commands the kit
prints name the interpreter that runs it; a Ctrl-C while the trainer imports is one line."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

import moe_train

ROOT = Path(__file__).resolve().parent.parent
# -S: this interpreter without its site-packages, so without numpy, jax, flax, ...
BARE = [sys.executable, "-S", "-m"]


def bare(module: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([*BARE, module, *args], cwd=ROOT, capture_output=True, text=True, timeout=60)


# each documented command, with arguments that get it past its argument parsing
COMMANDS = [
    ("moe_train", "--out", "r"),
    ("moe_train.convert", "to-hf", "a", "b"),
    ("moe_train.score", "ckpt"),
    ("moe_train.eval", "ckpt", "--data", "d"),
    ("moe_train.data", "prepare", "--train-tokenizer", "300", "--input", "x", "--out", "o"),
    ("moe_train.report", "runs/none"),
]


@pytest.mark.parametrize("command", COMMANDS, ids=lambda c: c[0])
def test_a_bare_python_gets_one_line_and_exit_2(command):
    proc = bare(*command)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr


def test_the_line_names_the_missing_module():
    assert "no module named 'jax'" in bare("moe_train.convert", "to-hf", "a", "b").stderr


def test_the_line_gives_the_command_with_its_arguments():
    stderr = bare("moe_train.report", "my run").stderr
    assert "-m moe_train.report 'my run'" in stderr, stderr


def test_a_command_that_needs_no_dependency_still_runs():
    assert bare("moe_train.convert", "--help").returncode == 0


# The hook as `python -m moe_train.convert` installs it, then an uncaught ModuleNotFoundError
HOOKED = """
import sys, moe_train
sys.orig_argv = [sys.executable, "-m", "moe_train.convert"]
moe_train._install_hint()
raise ModuleNotFoundError("No module named {0!r}", name={0!r})
"""


def hooked(missing: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", HOOKED.format(missing)], cwd=ROOT, capture_output=True, text=True, timeout=60
    )


def test_a_missing_module_of_the_kit_keeps_its_traceback():
    proc = hooked("moe_train.nowhere")
    assert proc.returncode == 1 and "Traceback" in proc.stderr, proc.stderr


def test_a_missing_dependency_raised_anywhere_is_one_line():
    proc = hooked("safetensors")
    assert proc.returncode == 2 and proc.stderr.startswith("error: python -m moe_train.convert")


def test_without_a_virtualenv_the_line_says_make_venv(tmp_path):
    assert "make venv" in moe_train._hint("moe_train.eval", "flax", repo=tmp_path)


def test_python_command_is_relative_below_the_working_directory(tmp_path):
    exe = tmp_path / ".venv" / "bin" / "python3.99"
    assert moe_train.python_command(str(exe), cwd=str(tmp_path)) == os.path.join(".venv", "bin", "python3.99")


def test_python_command_is_absolute_elsewhere(tmp_path):
    exe = "/opt/elsewhere/bin/python3.99"
    assert moe_train.python_command(exe, cwd=str(tmp_path)) == exe


# The trainer started as `python -m moe_train`, with a real SIGINT delivered while it imports
# moe_train.train.cli (an import hook sends it when that module is looked up).
CTRL_C_DURING_IMPORT = """
import os, runpy, signal, sys
class Interrupt:
    def find_spec(self, name, path=None, target=None):
        if name == "moe_train.train.cli":
            os.kill(os.getpid(), signal.SIGINT)
        return None
sys.meta_path.insert(0, Interrupt())
sys.argv = ["moe_train", "--out", "never"]
runpy.run_module("moe_train", run_name="__main__", alter_sys=True)
"""


def ctrl_c_during_import() -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", CTRL_C_DURING_IMPORT], cwd=ROOT, capture_output=True, text=True, timeout=60
    )


def test_ctrl_c_while_the_trainer_imports_exits_130():
    assert ctrl_c_during_import().returncode == 130


def test_ctrl_c_while_the_trainer_imports_prints_one_line_and_no_traceback():
    stderr = ctrl_c_during_import().stderr
    assert stderr.count("\n") == 1 and "Traceback" not in stderr, stderr
