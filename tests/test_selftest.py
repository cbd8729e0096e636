"""The startup self-test: kernel checks against references, and how auto/explicit choose."""

import json

import jax.numpy as jnp
import pytest
from helpers import records, tiny

from moe_train.config import ConfigError
from moe_train.moe import gemm, layer
from moe_train.selftest import candidates, checks, choose
from moe_train.train.loop import EXIT_OK, run

ROUTINGS = ("uniform", "zipf", "hot", "empty", "hot-empty")


@pytest.fixture
def broken_tiled(monkeypatch):
    """The tiled grouped GEMM, as the self-test calls it, returns rows scaled by 1.1."""
    real = gemm.grouped_swiglu

    def wrong(x, plan, w0, w1, wo, backend, **kw):
        y = real(x, plan, w0, w1, wo, backend, **kw)
        return y * 1.1 if backend == "tiled" else y

    monkeypatch.setattr(layer, "grouped_swiglu", wrong)  # the expert steps' (the self-test's too)


@pytest.mark.parametrize("routing", ROUTINGS)
@pytest.mark.parametrize("backend", ["tiled", "ragged_dot"])
def test_grouped_gemm_matches_reference_fp32(backend, routing):
    res = checks.check_gemm(backend, checks.GemmProblem(48, 32, 64, 8, 2, "float32", routing))
    assert res.ok and max(res.errors.values()) < 1e-5, res.line()


@pytest.mark.parametrize("backend", ["tiled", "ragged_dot"])
def test_grouped_gemm_matches_reference_bf16(backend):
    res = checks.check_gemm(backend, checks.GemmProblem(48, 32, 64, 8, 2, "bfloat16"))
    assert res.ok and set(res.errors) == {"output", "dx", "dw0", "dw1", "dwo"}, res.line()


def test_hot_empty_routing_is_adversarial():
    ids = checks.routing_ids(checks.GemmProblem(40, 8, 8, 8, 2, "float32", "hot-empty"))
    assert (ids == 0).any(axis=1).all() and not (ids == 7).any()


def test_broken_kernel_fails_its_check(broken_tiled):
    res = checks.check_gemm("tiled", checks.GemmProblem(48, 32, 64, 8, 2, "float32"))
    assert not res.ok and res.errors["output"] > 0.05


def test_kernel_that_raises_is_a_failed_check(monkeypatch):
    def boom(*a, **k):
        raise RuntimeError("kernel exploded")

    monkeypatch.setattr(layer, "grouped_swiglu", boom)
    res = checks.check_gemm("tiled", checks.GemmProblem(16, 8, 8, 4, 2, "float32"))
    assert not res.ok and "kernel exploded" in res.error


def test_non_finite_output_is_an_infinite_error():
    assert checks.rel_err(jnp.array([1.0, jnp.nan]), jnp.array([1.0, 2.0])) == float("inf")


@pytest.mark.parametrize("name", ["xla", "chunked"])
def test_attention_matches_reference(name):
    p = checks.AttentionProblem(1, 24, 4, 2, 16, 16, "float32")
    res = checks.check_attention(name, p)
    assert res.ok and max(res.errors.values()) < 1e-5, res.line()


@pytest.mark.parametrize("recipe", ["delayed", "current"])
def test_fp8_xla_projection_within_fp8_tolerance(recipe):
    res = checks.check_fp8("xla", recipe)
    assert res.ok and 1e-3 < res.errors["output"], res.line()  # quantized, not bf16


def test_broken_fp8_projection_fails():
    res = checks.check_fp8("xla", fn=lambda x, w: (x @ w).astype(jnp.float32) * 1.5)
    assert not res.ok


def _fake_check(bad: set[str]):
    def check(name, reps):
        err = 1.0 if name in bad else 1e-7
        return checks.Result("moe.backend", name, name not in bad, {"output": err}, {"output": 1e-3}, None)

    return check


def test_auto_skips_a_failing_candidate():
    got = choose("moe.backend", "auto", ["tiled", "ragged_dot"], _fake_check({"tiled"}), skip=False)
    assert got.chosen == "ragged_dot" and "tiled FAILED" in got.why


def test_auto_stops_at_the_first_passing_candidate():
    got = choose("moe.backend", "auto", ["tiled", "ragged_dot"], _fake_check(set()), skip=False)
    assert got.chosen == "tiled" and [r.name for r in got.results] == ["tiled"]


def test_auto_with_every_candidate_failing_is_a_config_error():
    with pytest.raises(ConfigError, match="every candidate failed"):
        choose(
            "moe.backend", "auto", ["tiled", "ragged_dot"], _fake_check({"tiled", "ragged_dot"}), skip=False
        )


def test_explicit_failing_choice_is_refused_with_numbers():
    with pytest.raises(ConfigError, match=r"moe.backend=tiled failed its self-test.*1\.00e\+00"):
        choose("moe.backend", "tiled", ["tiled", "ragged_dot"], _fake_check({"tiled"}), skip=False)


def test_skip_selftest_uses_an_explicit_choice_unchecked():
    got = choose("moe.backend", "tiled", ["tiled"], _fake_check({"tiled"}), skip=True)
    assert got.chosen == "tiled" and got.results == ()


def test_by_speed_takes_a_clearly_faster_candidate():
    def check(name, reps):
        return checks.Result(
            "moe.backend",
            name,
            True,
            {"output": 0.0},
            {"output": 1e-3},
            {"a": 1.0, "b": 0.5, "c": 0.95}[name],
        )

    got = choose("moe.backend", "auto", ["a", "b", "c"], check, skip=False, by_speed=True)
    assert got.chosen == "b" and "fastest" in got.why


def test_recorded_choice_is_kept_while_it_passes():
    got = choose(
        "moe.backend", "auto", ["tiled", "ragged_dot"], _fake_check(set()), skip=False, recorded="ragged_dot"
    )
    assert got.chosen == "ragged_dot" and "resumed" in got.why


def test_trainer_logs_kernels_first_and_times_the_selftest(tmp_path):
    lines = []
    assert run(tiny(), tmp_path, log=lines.append) == EXIT_OK
    if lines[0] == "running the kernel self-test ...":  # printed when the self-test takes over 2 s
        lines = lines[1:]
    assert lines[0].startswith("kernels on cpu: moe.backend=tiled") and "model.attention=" in lines[0]
    first = records(tmp_path)[0]
    assert first["selftest_s"] > 0
    kept = json.loads((tmp_path / "kernels.json").read_text())
    assert [c["chosen"] for c in kept["choices"]][0] == "tiled"


def test_trainer_auto_falls_back_from_a_broken_kernel(tmp_path, broken_tiled):
    lines = []
    assert run(tiny("train.steps=1"), tmp_path, log=lines.append) == EXIT_OK
    # the kernel line (a "running the kernel self-test ..." line comes first after 2 s)
    kernel = next(line for line in lines if "moe.backend=" in line)
    assert "moe.backend=ragged_dot" in kernel and "tiled FAILED" in kernel


def test_trainer_refuses_an_explicit_broken_kernel_and_writes_nothing(tmp_path, broken_tiled):
    out = tmp_path / "run"
    with pytest.raises(ConfigError, match="moe.backend=tiled failed its self-test"):
        run(tiny("moe.backend=tiled"), out, log=lambda s: None)
    assert not out.exists()


def test_trainer_skip_selftest_trains_with_the_explicit_kernel(tmp_path, broken_tiled):
    lines = []
    assert (
        run(
            tiny("moe.backend=tiled", "train.skip_selftest=true", "train.steps=1"), tmp_path, log=lines.append
        )
        == EXIT_OK
    )
    assert any("skip_selftest=true" in line for line in lines)


def test_explicit_backend_that_cannot_run_here_names_the_choices(tmp_path):
    with pytest.raises(ConfigError, match="moe.backend=mgpu cannot run here.*auto, tiled, ragged_dot"):
        run(tiny("moe.backend=mgpu"), tmp_path, log=lambda s: None)


def test_float32_is_held_to_its_own_bound_off_a_tpu():
    assert checks.tolerance("float32") == checks.TOLERANCE["float32"]


def test_a_tpu_at_default_precision_holds_float32_to_the_bf16_bound(monkeypatch):
    monkeypatch.setattr(checks.Platform, "here", staticmethod(lambda: checks.Platform("tpu", "TPU v5 lite")))
    assert checks.tolerance("float32") == checks.TOLERANCE["bfloat16"]
    with checks.jax.default_matmul_precision("highest"):
        assert checks.tolerance("float32") == checks.TOLERANCE["float32"]


TPU_V5E = checks.Platform("tpu", "TPU v5 lite")


def test_auto_on_a_tpu_refuses_tile_rows_megablox_cannot_pad_to():
    with pytest.raises(ConfigError, match=r"moe.tile_rows=24: moe.backend=auto runs megablox.*e.g. 16 or 0"):
        candidates.gemm_candidates(tiny("moe.tile_rows=24"), TPU_V5E)


def test_auto_on_a_tpu_takes_tile_rows_megablox_can_pad_to():
    assert candidates.gemm_candidates(tiny("moe.tile_rows=32"), TPU_V5E)[0] == "megablox"
