"""The units ``make test`` schedules (tests/conftest.py, ``--dist loadgroup``): the process
modules run on one worker, one after another (their Slurm jobs and ``jax.distributed`` peers
would otherwise race each other for the cores), and the tests of a module that defines a shared
fixture run on one worker (which builds it once)."""

import os
import subprocess
import sys
from pathlib import Path

import conftest
import pytest

TESTS = Path(__file__).parent
ROOT = TESTS.parent


@pytest.mark.parametrize("module", sorted(conftest.PROCESS_MODULES))
def test_each_process_module_exists(module):
    assert (TESTS / f"{module}.py").is_file()


def test_the_process_modules_are_one_unit():
    units = {conftest.group_of(f"tests/{m}.py::test_x", ROOT) for m in conftest.PROCESS_MODULES}
    assert units == {"processes"}


def test_a_module_with_a_shared_fixture_is_one_unit():
    ids = ["tests/test_stepper.py::test_a", "tests/test_stepper.py::test_b[1]"]
    assert {conftest.group_of(i, ROOT) for i in ids} == {"tests/test_stepper.py"}


def test_any_other_test_is_a_unit_of_its_own():
    nodeid = "tests/test_notation.py::test_x"
    assert not conftest.defines_a_shared_fixture(ROOT / "tests/test_notation.py")
    assert conftest.group_of(nodeid, ROOT) == nodeid


MODULE = """
import os, time
import pytest

@pytest.mark.parametrize("i", range(6))
def test_records_its_worker(i):
    time.sleep(0.2)
    with open(os.environ["UNITS_LOG"], "a") as f:
        f.write(f"{__name__} {os.environ['PYTEST_XDIST_WORKER']}\\n")
"""

CONFTEST = f"""
import importlib.util
spec = importlib.util.spec_from_file_location("suite_conftest", {str(TESTS / "conftest.py")!r})
suite = importlib.util.module_from_spec(spec)
spec.loader.exec_module(suite)
pytest_xdist_make_scheduler = suite.pytest_xdist_make_scheduler
"""


def test_xdist_runs_the_process_modules_on_one_worker(tmp_path):
    pytest.importorskip("xdist")
    for name in ("test_slurm_cluster", "test_multiprocess", "test_plain"):
        (tmp_path / f"{name}.py").write_text(MODULE)
    (tmp_path / "conftest.py").write_text(CONFTEST)
    log = tmp_path / "units.log"
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "2", "--dist", "loadgroup"]
    env = dict(os.environ, UNITS_LOG=str(log))
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = [line.split() for line in log.read_text().splitlines()]
    process_workers = {w for m, w in rows if m != "test_plain"}
    assert len(rows) == 18 and len(process_workers) == 1
