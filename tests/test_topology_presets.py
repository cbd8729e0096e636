"""Cluster presets load, match the hardware reference, and reject bad files clearly."""

from __future__ import annotations

import tomllib

import pytest

from topology import peaks, presets
from topology.presets import TopologyError

EXPECTED = ("cpu-local", "h100-dgx", "h200-hgx", "b200-hgx", "gb200-nvl72", "gb200-nvl36x2")
# preset -> device_kind string JAX reports, for the cross-check against topology.peaks
DEVICE_KIND = {
    "h100-dgx": "NVIDIA H100 80GB HBM3",
    "h200-hgx": "NVIDIA H200",
    "b200-hgx": "NVIDIA B200",
    "gb200-nvl72": "NVIDIA GB200",
    "gb200-nvl36x2": "NVIDIA GB200",
}


def test_expected_presets_exist():
    assert sorted(EXPECTED) == presets.list_presets()


@pytest.mark.parametrize("name", EXPECTED)
def test_every_preset_loads(name):
    c = presets.load(name)
    assert c.name == name
    assert c.domain_size % c.gpus_per_node == 0
    assert c.image  # an image exists for the preset's own architecture
    assert c.slurm.gpus_per_node == c.gpus_per_node
    assert c.nominal == (name == "cpu-local")


@pytest.mark.parametrize("name", EXPECTED)
def test_every_env_var_has_a_source(name):
    c = presets.load(name)
    assert c.env, "every preset sets some environment"
    assert set(c.env) == set(c.env_source)
    assert all(c.env_source[k].strip() for k in c.env)


def test_numbers_match_reference_table():
    h100 = presets.load("h100-dgx")
    assert h100.peak_bf16_flops == 989e12 and h100.peak_fp8_flops == 1979e12
    assert h100.nvlink_gbps_per_gpu == 450 and h100.nic_gbps_per_gpu == 50
    assert h100.domain_size == 8 and h100.cpu_arch == "x86_64"
    h200 = presets.load("h200-hgx")
    assert (h200.peak_bf16_flops, h200.nvlink_gbps_per_gpu, h200.nic_gbps_per_gpu) == (989e12, 450, 50)
    b200 = presets.load("b200-hgx")
    assert (b200.peak_bf16_flops, b200.peak_fp8_flops) == (2250e12, 4500e12)
    assert b200.nvlink_gbps_per_gpu == 900 and b200.domain_size == 8
    for name in ("gb200-nvl72", "gb200-nvl36x2"):
        gb = presets.load(name)
        assert gb.domain_size == 72 and gb.gpus_per_node == 4 and gb.nodes_per_domain == 18
        assert gb.nvlink_gbps_per_gpu == 900 and gb.nic_gbps_per_gpu == 50
        assert gb.cpu_arch == "aarch64" and "aarch64" in gb.container_image
        assert gb.peak_bf16_flops == 2500e12 and gb.peak_fp8_flops == 5000e12
        assert gb.slurm.segment and "--segment=18" in gb.sbatch_args()


def test_latencies_are_nccl_simple_protocol_constants():
    for name in EXPECTED[1:]:
        c = presets.load(name)
        assert (c.latency_nvlink_us, c.latency_network_us) == (3.4, 14.0)


@pytest.mark.parametrize("name", DEVICE_KIND)
def test_peaks_agree_with_peaks_module(name):
    c = presets.load(name)
    assert c.peak_bf16_flops == peaks.peak_flops(DEVICE_KIND[name], "bf16")
    assert c.peak_fp8_flops == peaks.peak_flops(DEVICE_KIND[name], "fp8")


def test_blackwell_does_not_set_cuda_device_max_connections():
    for name in ("b200-hgx", "gb200-nvl72", "gb200-nvl36x2"):
        assert "CUDA_DEVICE_MAX_CONNECTIONS" not in presets.load(name).env
    assert presets.load("h100-dgx").env["CUDA_DEVICE_MAX_CONNECTIONS"] == "1"


def test_cluster_is_frozen():
    c = presets.load("h100-dgx")
    # what the checker refuses too, done anyway: it must fail at run time
    with pytest.raises(AttributeError):
        c.domain_size = 16  # pyright: ignore[reportAttributeAccessIssue]
    with pytest.raises(TypeError):
        c.env["NCCL_IB_SL"] = "0"  # pyright: ignore[reportIndexIssue]


def test_unknown_preset_lists_presets():
    with pytest.raises(TopologyError, match="unknown cluster preset 'h300'.*h100-dgx") as e:
        presets.load("h300")
    assert isinstance(e.value, ValueError)
    assert "\n" not in str(e.value)


def _site_file(tmp_path, edit=lambda text: text, name="my-site.toml"):
    text = (presets.PRESET_DIR / "h100-dgx.toml").read_text()
    path = tmp_path / name
    path.write_text(edit(text))
    return path


def test_site_file_loads_from_path(tmp_path):
    path = _site_file(tmp_path, lambda t: t.replace("nic_gbps_per_gpu = 50.0", "nic_gbps_per_gpu = 100.0"))
    c = presets.load(path)
    assert c.name == "my-site" and c.nic_gbps_per_gpu == 100.0
    assert presets.load(str(path)) == c


def test_unknown_key_names_key_and_valid_keys(tmp_path):
    path = _site_file(tmp_path, lambda t: t.replace("domain_size = 8", "domian_size = 8"))
    with pytest.raises(TopologyError, match="unknown key 'domian_size'; valid keys: .*domain_size"):
        presets.load(path)


def test_unknown_slurm_key(tmp_path):
    path = _site_file(tmp_path, lambda t: t.replace("exclusive = true", "exclusiv = true"))
    with pytest.raises(TopologyError, match=r"\[slurm\]: unknown key 'exclusiv'.*exclusive"):
        presets.load(path)


def test_env_var_without_source_is_rejected(tmp_path):
    path = _site_file(
        tmp_path, lambda t: t.replace('NCCL_IB_SL = "1"\n', 'NCCL_IB_SL = "1"\nNCCL_DEBUG = "WARN"\n')
    )
    with pytest.raises(TopologyError, match="'NCCL_DEBUG' has no entry in \\[env_source\\]"):
        presets.load(path)


@pytest.mark.parametrize(
    "old,new,match",
    [
        ('cpu_arch = "x86_64"', 'cpu_arch = "arm64"', "cpu_arch 'arm64' is not one of x86_64, aarch64"),
        ("eta_nvlink = 0.82", "eta_nvlink = 1.5", r"'eta_nvlink' must be a number in \(0, 1\]"),
        (
            "nvlink_gbps_per_gpu = 450.0",
            "nvlink_gbps_per_gpu = nan",
            "key 'nvlink_gbps_per_gpu' must be finite, got nan",
        ),
        (
            "nic_gbps_per_gpu = 50.0",
            "nic_gbps_per_gpu = inf",
            "key 'nic_gbps_per_gpu' must be finite, got inf",
        ),
        (
            "nic_gbps_per_gpu = 50.0",
            "nic_gbps_per_gpu = -50.0",
            "key 'nic_gbps_per_gpu' must be a positive number, got -50.0",
        ),
        (
            "latency_network_us = 14.0",
            "latency_network_us = inf",
            "key 'latency_network_us' must be finite, got inf",
        ),
        (
            "latency_nvlink_us = 3.4",
            "latency_nvlink_us = -3.4",
            "key 'latency_nvlink_us' must be a number >= 0, got -3.4",
        ),
        ("peak_bf16_tflops = 989.0", "peak_bf16_tflops = -inf", "key 'peak_bf16_tflops' must be finite"),
        ("hbm_tbps = 3.35", "hbm_tbps = nan", "key 'hbm_tbps' must be finite, got nan"),
        (
            "ntasks_per_node = 8",
            "ntasks_per_node = 0",
            "slurm.ntasks_per_node must be a positive number, got 0",
        ),
        ("domain_size = 8 ", "domain_size = 12 ", "not a multiple of gpus_per_node"),
        ("gpus_per_node = 8\nc", "gpus_per_node = 8.5\nc", "'gpus_per_node' must be int"),
        ("ntasks_per_node = 8", "ntasks_per_node = 8\nfoo = 1", "unknown key 'foo'"),
    ],
)
def test_bad_values_are_rejected(tmp_path, old, new, match):
    path = _site_file(tmp_path, lambda t: t.replace(old, new, 1))
    assert path.read_text() != (presets.PRESET_DIR / "h100-dgx.toml").read_text()
    with pytest.raises(TopologyError, match=match):
        presets.load(path)


def test_missing_key_and_missing_file(tmp_path):
    path = _site_file(tmp_path, lambda t: t.replace("eta_network = 0.86", ""))
    with pytest.raises(TopologyError, match="missing key 'eta_network'"):
        presets.load(path)
    with pytest.raises(TopologyError, match="does not exist"):
        presets.load(tmp_path / "nope.toml")


def test_shipped_files_are_plain_toml():
    for name in EXPECTED:
        with (presets.PRESET_DIR / f"{name}.toml").open("rb") as f:
            assert "env_source" in tomllib.load(f)
