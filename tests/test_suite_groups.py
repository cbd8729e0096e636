"""The xdist groups of tests/conftest.py name real test modules (a renamed module would
otherwise leave its Slurm jobs racing the rest of the suite for the cluster's cores)."""

from pathlib import Path

import conftest
import pytest

TESTS = Path(__file__).parent


@pytest.mark.parametrize("module", sorted(conftest.PROCESS_MODULES))
def test_each_process_module_exists(module):
    assert (TESTS / f"{module}.py").is_file()


def test_the_tests_of_a_module_fixture_share_a_group(request):
    items = [
        i
        for i in request.session.items
        if i.nodeid.startswith("tests/test_stepper.py") and "two_in_a_row" in i.fixturenames
    ]
    if not items:
        pytest.skip("tests/test_stepper.py is not collected in this run")
    assert {conftest.xdist_group(i) for i in items} == {"test_stepper"}
