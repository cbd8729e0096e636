"""Every number a topology file holds is finite and in range: calibration files (``topology
probe``), compute files (``plan --compute``) and site presets. A bad one is one line naming
the file and the key, exit 2 from the CLI, never a traceback later in the planner."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from helpers import run_module, toml_key

from moe_train.planner import compute
from topology import calibration, presets
from topology.calibration import Fit, Sample
from topology.presets import TopologyError


def _calibration(tmp_path: Path, old: str, new: str) -> Path:
    """A calibration file as ``topology probe`` writes it, with one line edited."""
    path = calibration.write(
        tmp_path / "cal.toml",
        "cpu-local",
        "nvlink",
        Fit(20e-6, 300e9),
        [Sample(4096, 3e-5), Sample(8192, 4e-5)],
        "cpu",
        4,
    )
    text = path.read_text()
    assert old in text
    path.write_text(text.replace(old, new, 1))
    return path


def _plan(*extra: str, preset: str = "cpu-local") -> subprocess.CompletedProcess:
    job = ["--preset", preset, "--nodes", "2", "--model", "tiny", "--ep", "8"]
    return run_module("moe_train.planner.ep_plan", *job, *extra, timeout=300)


@pytest.mark.parametrize(
    "old,new,message",
    [
        (
            "gbps_per_gpu = 300.000000",
            "gbps_per_gpu = nan",
            "calibration.gbps_per_gpu must be finite, got nan",
        ),
        ("latency_us = 20.0000", "latency_us = inf", "calibration.latency_us must be finite, got inf"),
        (
            "gbps_per_gpu = 300.000000",
            "gbps_per_gpu = -300.0",
            "calibration.gbps_per_gpu must be a positive number, got -300.0",
        ),
        (
            "latency_us = 20.0000",
            "latency_us = -1.0",
            "calibration.latency_us must be a number >= 0, got -1.0",
        ),
        (
            "latency_us = 20.0000",
            'latency_us = "fast"',
            "calibration.latency_us must be a number, got 'fast'",
        ),
        (
            "seconds = 0.000040000",
            "seconds = nan",
            r"calibration.samples\[1\].seconds must be finite, got nan",
        ),
    ],
)
def test_a_bad_calibration_number_names_the_key_and_file(tmp_path, old, new, message):
    path = _calibration(tmp_path, old, new)
    with pytest.raises(TopologyError, match=rf"^{path}: {message}$"):
        calibration.read(path)


def test_a_calibration_of_zero_latency_is_accepted(tmp_path):
    path = _calibration(tmp_path, "latency_us = 20.0000", "latency_us = 0")
    assert calibration.apply(presets.load("cpu-local"), path).latency_nvlink_us == 0.0


def test_plan_with_a_nan_calibration_exits_2_with_one_line(tmp_path):
    path = _calibration(tmp_path, "gbps_per_gpu = 300.000000", "gbps_per_gpu = nan")
    proc = _plan("--calibration", str(path))
    assert (proc.returncode, proc.stderr.splitlines()) == (
        2,
        [f"error: {path}: calibration.gbps_per_gpu must be finite, got nan"],
    )


def test_plan_with_an_infinite_site_latency_exits_2_with_one_line(tmp_path):
    site = tmp_path / "site.toml"
    text = (presets.PRESET_DIR / "cpu-local.toml").read_text()
    site.write_text(text.replace("latency_network_us = ", "latency_network_us = inf #", 1))
    proc = _plan(preset=str(site))
    assert (proc.returncode, proc.stderr.splitlines()) == (
        2,
        [f"error: {site}: key 'latency_network_us' must be finite, got inf"],
    )


@pytest.mark.parametrize(
    "value,message",
    [
        ("nan", "must be finite, got nan"),
        ("inf", "must be finite, got inf"),
        ("0", r"must be a number in \(0, 1\], got 0"),
        ("true", "must be a number, got True"),
    ],
)
def test_a_bad_compute_number_names_the_key_and_file(tmp_path, value, message):
    path = tmp_path / "compute.toml"
    path.write_text(toml_key(compute.DEFAULTS.read_text(), "gemm_efficiency", value))
    with pytest.raises(TopologyError, match=rf"^{path}: compute.gemm_efficiency {message}$"):
        compute.load(path)


def test_a_nan_published_figure_names_the_anchor(tmp_path, monkeypatch):
    path = tmp_path / "anchors.toml"
    path.write_text(compute.ANCHORS.read_text().replace("tflops_per_gpu = 1276", "tflops_per_gpu = nan", 1))
    monkeypatch.setattr(compute, "ANCHORS", path)
    with pytest.raises(TopologyError, match=rf"^{path}: anchor\[0\].tflops_per_gpu must be finite"):
        compute.anchors("deepseek-v3", "gb200-nvl72")
