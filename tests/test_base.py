"""The ground floor (``moe_train.base``): the TOML reader every file reader shares, and ``cdiv``."""

import pytest

from moe_train.base.arith import cdiv
from moe_train.base.tomlfile import read_toml


class CallersError(ValueError):
    """Any caller's own error type."""


def test_read_toml_names_the_file_of_invalid_toml_in_the_callers_error(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("[a\nx = 1\n")
    with pytest.raises(CallersError, match=rf"^site file {bad}: not valid TOML"):
        read_toml(bad, CallersError, what="site file ")


def test_read_toml_turns_an_unreadable_path_into_the_callers_error(tmp_path):
    with pytest.raises(CallersError, match=rf"^{tmp_path}: Is a directory"):
        read_toml(tmp_path, CallersError)


def test_read_toml_returns_the_tables(tmp_path):
    good = tmp_path / "good.toml"
    good.write_text("[a]\nx = 1\n")
    assert read_toml(good, CallersError) == {"a": {"x": 1}}


@pytest.mark.parametrize("a,b,want", [(0, 8, 0), (1, 8, 1), (8, 8, 1), (9, 8, 2), (20, 8, 3)])
def test_cdiv_rounds_up(a, b, want):
    assert cdiv(a, b) == want
