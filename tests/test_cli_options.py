"""``moe_train.config.cli``: the ``--out`` option and comma lists the tool commands share."""

import argparse
from pathlib import Path

from moe_train.config.cli import add_out_option, comma_list


def test_out_option_is_a_path_with_its_default_and_layout_in_the_help():
    ap = argparse.ArgumentParser()
    add_out_option(ap, "runs/x", "<UTC>/")
    assert ap.parse_args([]).out == Path("runs/x")
    assert ap.parse_args(["--out", "o"]).out == Path("o")
    assert "results go to OUT/<UTC>/ (default: runs/x)" in " ".join(ap.format_help().split())


def test_comma_list_drops_empty_names():
    assert comma_list("a,,b,") == ["a", "b"]
    assert comma_list("") == []
