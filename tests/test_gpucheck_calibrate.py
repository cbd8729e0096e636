"""gpu-check's compute section: the file it writes is one ``make plan --compute`` reads, with
the measured fields replaced and the rest the shipped defaults (no GPU needed to check that)."""

import time

from moe_train.gpucheck import Context, calibrate
from topology import compute

SPEED = {"name": "gemm_speed", "rows": [
    {"backend": "tiled", "mode": "fwd+bwd", "routing": "uniform", "ratio": 1.6, "status": "PASS"},
    {"backend": "mgpu", "mode": "fwd+bwd", "routing": "uniform", "ratio": 1.2, "status": "PASS"},
    {"backend": "te", "mode": "fwd+bwd", "routing": "uniform", "ratio": 0.9, "status": "SKIP"},
    {"backend": "mgpu", "mode": "fwd", "routing": "uniform", "ratio": 1.0, "status": "PASS"},
    {"backend": "mgpu", "mode": "fwd+bwd", "routing": "one-hot", "ratio": 1.1, "status": "PASS"},
]}


def test_the_best_passing_uniform_forward_backward_ratio_is_taken():
    assert calibrate.grouped_ratio(({"name": "env"}, SPEED)) == (1.2, "mgpu")
    assert calibrate.grouped_ratio(({"name": "env"},)) is None


def test_the_written_file_reads_back_with_the_measured_fields(tmp_path):
    base = compute.load()
    text = calibrate.file_text({"gemm_efficiency": 0.75, "grouped_gemm_efficiency": 0.5},
                               {"gemm_efficiency": "measured \"here\""}, base)
    (tmp_path / "c.toml").write_text(text)
    got = compute.load(tmp_path / "c.toml")
    assert (got.gemm_efficiency, got.grouped_gemm_efficiency) == (0.75, 0.5)
    assert got.attention_efficiency == base.attention_efficiency
    assert got.source["gemm_efficiency"] == "measured 'here'"
    assert got.source["attention_efficiency"].startswith("shipped default")


def test_a_measured_share_above_one_is_clamped(tmp_path):
    (tmp_path / "c.toml").write_text(calibrate.file_text({"gemm_efficiency": 1.3}, {},
                                                         compute.load()))
    assert compute.load(tmp_path / "c.toml").gemm_efficiency == 1.0


def test_without_a_gpu_peak_the_section_is_skipped_with_the_reason(tmp_path):
    ctx = Context("cpu", 1, tmp_path, time.perf_counter() + 10, "cpu", (SPEED,))
    out = calibrate.section(ctx)
    assert out["status"] == "SKIP" and "no dense bf16 peak" in out["reason"]
    assert not (tmp_path / "compute.toml").exists()
