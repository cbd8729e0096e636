"""Site files (``slurm/site.py``): every number read from one is finite and in range, else exit 2
with one line naming the file and the key."""

from pathlib import Path

import pytest
from helpers import refused, run_module

from slurm import site


def _site(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "site.toml"
    path.write_text(text)
    return path


@pytest.mark.parametrize(
    "text,message",
    [
        ("max_requeues = nan", "max_requeues must be int, got nan"),
        ("max_requeues = inf", "max_requeues must be int, got inf"),
        ("max_requeues = -inf", "max_requeues must be int, got -inf"),
        ("max_requeues = 2.5", "max_requeues must be int, got 2.5"),
        ("max_requeues = true", "max_requeues must be int, got True"),
        ("max_requeues = -1", "max_requeues must be in [0, 1000], got -1"),
        (
            "max_requeues = 99999999999999999999",
            "max_requeues must be in [0, 1000], got 99999999999999999999",
        ),
    ],
    ids=["nan", "inf", "-inf", "fraction", "bool", "negative", "beyond 64 bits"],
)
def test_a_bad_site_number_names_the_file_and_the_key(tmp_path, text, message):
    path = _site(tmp_path, text)
    with pytest.raises(site.SiteError) as err:
        site.load(path)
    assert str(err.value) == f"site file {path}: {message}"


def test_the_bounds_of_max_requeues_are_accepted(tmp_path):
    loaded = [site.load(_site(tmp_path, f"max_requeues = {n}")).max_requeues for n in (0, 1000)]
    assert loaded == [0, 1000]


def test_submit_with_a_nan_in_the_site_file_exits_2_with_one_line(tmp_path):
    path = _site(tmp_path, "max_requeues = nan")
    args = ("--preset", "cpu-local", "--model", "tiny", "--nodes", "1", "--out", tmp_path / "run")
    line = refused(run_module("slurm.submit", *args, "--site", path, "--dry-run"))
    assert line == f"error: site file {path}: max_requeues must be int, got nan"
