"""The all-to-all probe and the calibration files it writes."""

import jax
import pytest
from helpers import run_module

from topology import calibration, probe
from topology.calibration import Fit, Sample
from topology.presets import TopologyError, load


def test_exchange_moves_block_j_of_device_i_to_block_i_of_device_j():
    assert probe.check_exchange(jax.devices()[:4])


def test_measure_reports_bytes_each_device_sends():
    samples = probe.measure(jax.devices()[:4], [3 * 4 * 16, 3 * 4 * 64], warmup=1, reps=2)
    assert [s.bytes_per_device for s in samples] == [3 * 4 * 16, 3 * 4 * 64]
    assert all(s.seconds > 0 for s in samples)


def test_measure_refuses_one_device():
    with pytest.raises(ValueError, match="at least 2 devices"):
        probe.measure(jax.devices()[:1], [1024])


def test_sizes_double_from_min_to_max():
    assert probe.sizes(1000, 8192) == [1024, 2048, 4096, 8192]


def test_fit_recovers_a_line():
    samples = [Sample(b, 20e-6 + b / 300e9) for b in (1 << 20, 1 << 22, 1 << 24)]
    got = calibration.fit(samples)
    assert got.latency_s == pytest.approx(20e-6, rel=1e-6)
    assert got.rate_bytes_per_s == pytest.approx(300e9, rel=1e-6)


def test_fit_of_flat_noise_uses_the_largest_message():
    got = calibration.fit([Sample(1000, 2e-3), Sample(2000, 1e-3)])
    assert got.rate_bytes_per_s == pytest.approx(2000 / 1e-3)


def test_fit_needs_two_sizes():
    with pytest.raises(ValueError, match="two message sizes"):
        calibration.fit([Sample(1000, 1e-3), Sample(1000, 2e-3)])


def h100_calibration(tmp_path, link: str, fit: Fit, gpus: int):
    """A calibration file of ``link`` on h100-dgx, one sample, as ``topology probe`` writes it."""
    samples = [Sample(1 << 20, 3e-5)]
    return calibration.write(
        tmp_path / "cal.toml", "h100-dgx", link, fit, samples, "NVIDIA H100 80GB HBM3", gpus
    )


def test_nvlink_calibration_replaces_nvlink_numbers(tmp_path):
    path = h100_calibration(tmp_path, "nvlink", Fit(25e-6, 320e9), 8)
    c = calibration.apply(load("h100-dgx"), path)
    assert (c.nvlink_gbps_per_gpu, c.latency_nvlink_us, c.eta_nvlink) == (320.0, 25.0, 1.0)
    assert c.nic_gbps_per_gpu == load("h100-dgx").nic_gbps_per_gpu


def test_network_calibration_replaces_network_numbers(tmp_path):
    path = h100_calibration(tmp_path, "network", Fit(40e-6, 41e9), 16)
    c = calibration.apply(load("h100-dgx"), path)
    assert (c.nic_gbps_per_gpu, c.latency_network_us, c.eta_network) == (41.0, 40.0, 1.0)


def test_calibration_without_table_is_refused(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("x = 1\n")
    with pytest.raises(TopologyError, match="no \\[calibration\\] table"):
        calibration.apply(load("h100-dgx"), bad)


def test_calibration_with_zero_rate_is_refused(tmp_path):
    path = calibration.write(tmp_path / "cal.toml", "h100-dgx", "nvlink", Fit(1e-6, 1e9), [], "cpu", 8)
    path.write_text(path.read_text().replace("gbps_per_gpu = 1.000000", "gbps_per_gpu = 0"))
    with pytest.raises(TopologyError, match="gbps_per_gpu must be a positive number"):
        calibration.apply(load("h100-dgx"), path)


def _cli(*args: str):
    return run_module("topology", *args, timeout=300)


@pytest.fixture(scope="module")
def probed(tmp_path_factory):
    out = tmp_path_factory.mktemp("probe") / "cal.toml"
    sizes = "--devices 4 --min-bytes 4096 --max-bytes 65536 --reps 2".split()
    proc = _cli("probe", "--preset", "cpu-local", "--out", out, *sizes)
    assert proc.returncode == 0, proc.stderr
    return out, proc.stdout


def test_probe_cli_calibrates_the_one_domain_as_nvlink(probed):
    assert calibration.read(probed[0])["link"] == "nvlink"


def test_probe_cli_records_every_size(probed):
    assert len(calibration.read(probed[0])["samples"]) == 5  # 4, 8, 16, 32, 64 KiB


def test_plan_uses_the_calibration(probed):
    import json

    args = ["--preset", "cpu-local", "--nodes", "2", "--model", "tiny", "--ep", "8", "--json"]
    plan = lambda *more: run_module("moe_train.planner.ep_plan", *args, *more, timeout=300)
    base = json.loads(plan().stdout)
    calibrated = json.loads(plan("--calibration", str(probed[0])).stdout)
    assert calibrated["a2a_seconds"]["planned"] != base["a2a_seconds"]["planned"]


def test_probe_cli_unknown_preset_is_one_line_exit_2(tmp_path):
    proc = _cli("probe", "--preset", "nope", "--out", str(tmp_path / "c.toml"))
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1
    assert "valid presets" in proc.stderr
