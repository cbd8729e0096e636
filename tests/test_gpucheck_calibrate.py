"""gpu-check's compute section: the file it writes is one ``make plan --compute`` reads, with
the measured fields replaced and the rest the shipped defaults (no GPU needed to check that)."""

import time

import pytest

from moe_train.gpucheck import Context, calibrate
from moe_train.planner import compute

F = 8.66e12  # useful FLOPs of one row (Mixtral experts, T 4096, fwd+bwd)
SPEED = {
    "name": "gemm_speed",
    "rows": [
        {
            "backend": "tiled",
            "mode": "fwd+bwd",
            "routing": "uniform",
            "time_ms": 35.0,
            "useful_flops": F,
            "status": "PASS",
        },
        {
            "backend": "mgpu",
            "mode": "fwd+bwd",
            "routing": "uniform",
            "time_ms": 16.0,
            "useful_flops": F,
            "status": "PASS",
        },
        {
            "backend": "te",
            "mode": "fwd+bwd",
            "routing": "uniform",
            "time_ms": 9.0,
            "useful_flops": F,
            "status": "SKIP",
        },
        {
            "backend": "mgpu",
            "mode": "fwd",
            "routing": "uniform",
            "time_ms": 5.0,
            "useful_flops": F,
            "status": "PASS",
        },
        {
            "backend": "mgpu",
            "mode": "fwd+bwd",
            "routing": "hot",
            "time_ms": 10.0,
            "useful_flops": F,
            "status": "PASS",
        },
    ],
}


def found(rate: tuple[float, str] | None) -> tuple[float, str]:
    """(FLOP/s, what ran) of a rate the section's rows give."""
    assert rate is not None, "no rate from the rows"
    return rate


def test_the_fastest_passing_uniform_forward_backward_row_gives_the_grouped_rate():
    rate, what = found(calibrate.grouped_rate(({"name": "env"}, SPEED)))
    assert rate == pytest.approx(F / 16e-3) and what.startswith("mgpu")
    assert calibrate.grouped_rate(({"name": "env"},)) is None


def test_the_written_file_reads_back_with_the_measured_fields(tmp_path):
    base = compute.load()
    text = calibrate.file_text(
        {"gemm_efficiency": 0.75, "grouped_gemm_efficiency": 0.5},
        {"gemm_efficiency": 'measured "here"'},
        base,
    )
    (tmp_path / "c.toml").write_text(text)
    got = compute.load(tmp_path / "c.toml")
    assert (got.gemm_efficiency, got.grouped_gemm_efficiency) == (0.75, 0.5)
    assert got.attention_efficiency == base.attention_efficiency
    assert got.source["gemm_efficiency"] == "measured 'here'"
    assert got.source["attention_efficiency"].startswith("shipped default")


def test_a_measured_share_above_one_is_clamped(tmp_path):
    (tmp_path / "c.toml").write_text(calibrate.file_text({"gemm_efficiency": 1.3}, {}, compute.load()))
    assert compute.load(tmp_path / "c.toml").gemm_efficiency == 1.0


def test_without_a_gpu_peak_the_section_is_skipped_with_the_reason(tmp_path):
    ctx = Context("cpu", 1, tmp_path, time.perf_counter() + 10, "cpu", (SPEED,))
    out = calibrate.section(ctx)
    assert out["status"] == "SKIP" and "no dense bf16 peak" in out["reason"]
    assert not (tmp_path / "compute.toml").exists()


ATTN = {
    "name": "attention",
    "problem": {
        "batch": 1,
        "seq_len": 256,
        "heads": 4,
        "kv_heads": 2,
        "head_dim": 32,
        "v_head_dim": 32,
        "dtype": "float32",
    },
    "rows": [
        {"implementation": "xla", "status": "PASS", "time_ms": 1.0},
        {"implementation": "chunked", "status": "PASS", "time_ms": 2.0},
    ],
}
FP8 = {
    "name": "fp8",
    "rows": [
        {
            "backend": "xla",
            "shape": [64, 128, 128],
            "time_ms": 1.0,
            "status": "PASS",
            "fp8_gemm_calls": ["__cublas$lt$matmul$f8"],
        },
        {
            "backend": "te",
            "shape": [64, 128, 128],
            "time_ms": 0.5,
            "status": "PASS",
            "fp8_gemm_calls": [],
        },  # no fp8 GEMM: not an fp8 rate
        {"run": "fp8 vs bf16 loss, tiny, 50 steps", "status": "PASS"},
    ],
}


def test_attention_is_timed_on_the_implementation_auto_picks():
    # on CPU at S 256 auto picks chunked; the planner's model FLOPs 3 B S^2 N (Dqk + Dv)
    rate, what = found(calibrate.attention_rate((ATTN,), "cpu"))
    assert rate == pytest.approx(3 * 256**2 * 4 * 64 / 2e-3) and what.startswith("chunked")


def test_fp8_takes_the_fastest_row_with_fp8_gemms():
    rate, what = found(calibrate.fp8_rate((FP8,)))
    assert rate == pytest.approx(6 * 64 * 128 * 128 / 1e-3) and what.startswith("xla")


def test_attention_and_fp8_shares_of_their_peaks_are_measured(tmp_path):
    ctx = Context("gpu", 1, tmp_path, time.perf_counter() + 10, "NVIDIA H100 80GB HBM3", (ATTN, FP8))
    measured, why = {}, {}
    calibrate._measured_rates(ctx, 989e12, measured, why)
    assert measured["fp8_gemm_efficiency"] == pytest.approx(6 * 64 * 128 * 128 / 1e-3 / 1979e12)
    assert set(measured) == {"attention_efficiency", "fp8_gemm_efficiency"}
    assert why["attention_efficiency"].startswith("gpu-check: ")


def test_without_timed_rows_the_shares_keep_their_defaults(tmp_path):
    untimed = {**ATTN, "rows": [{"implementation": "chunked", "status": "FAIL"}]}
    assert calibrate.attention_rate((untimed,), "cpu") is None
    assert calibrate.fp8_rate(({"name": "fp8", "rows": []},)) is None
