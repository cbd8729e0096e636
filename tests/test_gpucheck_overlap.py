"""gpu-check's overlap section at toy sizes on the fake CPU devices: its checks, its numbers
and its profile (the GPU sizes run only on a GPU node)."""

import time

import jax
import pytest

from moe_train.gpucheck import Context, overlap


def ctx(tmp_path, devices: int) -> Context:
    return Context("cpu", devices, tmp_path, time.perf_counter() + 60, "cpu")


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    out = tmp_path_factory.mktemp("overlap")
    return overlap.section(ctx(out, 4), jax.devices()[:4]), out


def test_every_variant_is_within_its_bound_of_chunks_one(result):
    res, _ = result
    assert res["status"] == "PASS", res["reason"]
    assert [(r["chunks"], r["dispatch_dtype"]) for r in res["rows"]] == list(overlap.VARIANTS)


def test_chunked_rows_move_the_same_bytes_and_fp8_fewer(result):
    rows = {(r["chunks"], r["dispatch_dtype"]): r for r in result[0]["rows"]}
    ref = rows[1, "activation"]["fwd_bytes_per_device"]
    assert rows[4, "activation"]["fwd_bytes_per_device"] == ref
    assert rows[4, "fp8"]["fwd_bytes_per_device"] < ref


def test_the_gain_comes_from_the_fastest_chunked_row(result):
    res, _ = result
    chunked = [r for r in res["rows"] if r["dispatch_dtype"] == "activation" and r["chunks"] > 1]
    best = min(chunked, key=lambda r: r["time_ratio"])
    assert res["best_chunks"] == best["chunks"]
    assert res["overlap_gain"] == pytest.approx(1 - best["time_ratio"])


def test_a_profiler_trace_is_written(result):
    _, out = result
    assert list((out / overlap.TRACE_DIR).rglob("*.xplane.pb"))


def test_a_row_outside_its_bound_fails_with_the_numbers():
    row = {
        "chunks": 4,
        "dispatch_dtype": "activation",
        "y_rel_diff": 0.5,
        "grad_rel_diff": 0.0,
        "time": {"median_s": 1e-3},
    }
    got = overlap._checked(row)
    assert got["status"] == "FAIL" and "output 5.0e-01 (bound 2e-02)" in got["reason"]


def test_one_device_is_skipped_with_the_reason(tmp_path):
    res = overlap.section(ctx(tmp_path, 1), jax.devices()[:1])
    assert res["status"] == "SKIP" and "two or more" in res["reason"]
