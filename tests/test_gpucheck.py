"""make gpu-check: its CPU run end to end, and the pieces that decide PASS/FAIL/SKIP."""

import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from moe_train import gpucheck
from moe_train.gpucheck import __main__ as cli
from moe_train.gpucheck.kernels import hlo_gemms

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def cpu_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpucheck")
    proc = subprocess.run(
        [sys.executable, "-m", "moe_train.gpucheck", "--out", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    (run_dir,) = out.iterdir()
    return proc, json.loads((run_dir / "results.json").read_text()), run_dir


@pytest.mark.slow
def test_cpu_run_exits_zero(cpu_run):
    proc, _, _ = cpu_run
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]


@pytest.mark.slow
def test_cpu_run_has_every_section_passed_or_skipped_with_a_reason(cpu_run):
    _, results, _ = cpu_run
    got = {s["name"]: s for s in results["sections"]}
    assert list(got) == list(cli.SECTION_NAMES)
    for s in got.values():
        assert s["status"] in ("PASS", "SKIP"), (s["name"], s.get("reason"))
        assert s["status"] == "PASS" or s["reason"], s["name"]


@pytest.mark.slow
def test_cpu_run_checks_the_cpu_kernels(cpu_run):
    _, results, _ = cpu_run
    sec = {s["name"]: s for s in results["sections"]}
    ran = {(r["backend"], r["status"]) for r in sec["gemm_numerics"]["rows"]}
    assert {("tiled", "PASS"), ("ragged_dot", "PASS"), ("mgpu", "SKIP"), ("te", "SKIP")} <= ran
    assert {r["implementation"] for r in sec["attention"]["rows"] if r["status"] == "PASS"} >= {
        "xla",
        "chunked",
    }
    assert sec["ep"]["status"] == "PASS" and sec["training"]["status"] == "PASS"


@pytest.mark.slow
def test_cpu_run_writes_markdown_and_stays_within_its_bound(cpu_run):
    _, results, run_dir = cpu_run
    md = (run_dir / "results.md").read_text()
    assert all(f"## {i}. " in md for i in range(1, 9))
    # bounded by its own budgets (scaled for a CPU), whatever the machine's speed
    assert results["wall_s"] < sum(s["budget_s"] for s in results["sections"]) + 30, results["wall_s"]


def test_a_cpu_run_scales_the_gpu_budgets():
    assert gpucheck.budget_scale("gpu") == 1.0
    assert gpucheck.budget_scale("cpu") == gpucheck.CPU_BUDGET_SCALE > 1


def test_results_are_flushed_after_each_section(tmp_path, monkeypatch):
    seen = []

    def second(ctx):
        seen.append(json.loads(next((tmp_path).rglob("results.json")).read_text()))
        return {"status": "PASS", "reason": ""}

    monkeypatch.setattr(
        cli,
        "sections",
        lambda: [
            gpucheck.Section("env", "first", 5, lambda ctx: {"status": "SKIP", "reason": "r"}),
            gpucheck.Section("ep", "second", 5, second),
        ],
    )
    assert cli.main(["--out", str(tmp_path), "--only", "env,ep"]) == 0
    assert [s["name"] for s in seen[0]["sections"]] == ["env"]


def test_a_failing_section_makes_the_exit_code_one_and_the_rest_still_run(tmp_path, monkeypatch):
    def boom(ctx):
        raise RuntimeError("kernel miscompute")

    monkeypatch.setattr(
        cli,
        "sections",
        lambda: [
            gpucheck.Section("env", "broken", 5, boom),
            gpucheck.Section("ep", "after", 5, lambda ctx: {"status": "PASS", "reason": ""}),
        ],
    )
    assert cli.main(["--out", str(tmp_path), "--only", "env,ep"]) == 1
    results = json.loads(next(tmp_path.rglob("results.json")).read_text())
    assert [s["status"] for s in results["sections"]] == ["FAIL", "PASS"]
    assert "kernel miscompute" in results["sections"][0]["reason"]


def test_a_long_section_prints_a_heartbeat_with_its_name_and_elapsed_time(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(gpucheck, "HEARTBEAT_S", 0.3)
    slow = gpucheck.Section("ep", "slow", 5, lambda ctx: time.sleep(1.0) or {"status": "PASS", "reason": ""})
    monkeypatch.setattr(cli, "sections", lambda: [slow])
    assert cli.main(["--out", str(tmp_path), "--only", "ep"]) == 0
    beats = re.findall(r"^\[gpu-check\] still running section ep: \d+ s", capsys.readouterr().out, re.M)
    assert len(beats) >= 2


def test_every_section_of_the_table_has_its_function():
    assert [s.name for s in cli.sections()] == list(cli.SECTION_NAMES)
    assert all(callable(s.run) for s in cli.sections())


def test_unknown_section_is_refused():
    with pytest.raises(SystemExit) as err:
        cli.parse(["--only", "env,warp"])
    assert err.value.code == 2


@pytest.mark.parametrize(
    "statuses, want",
    [(["PASS", "SKIP"], "PASS"), (["SKIP", "SKIP"], "SKIP"), (["PASS", "FAIL", "SKIP"], "FAIL")],
)
def test_section_verdict_from_rows(statuses, want):
    rows = [{"status": s, "reason": "why" if s != "PASS" else ""} for s in statuses]
    assert gpucheck.verdict(rows)["status"] == want


def test_hlo_reader_names_fp8_gemm_custom_calls():
    hlo = (
        "%c = (bf16[64,64]{1,0}, s8[0]{0}) custom-call(f8e4m3fn[64,64]{1,0} %a, f8e4m3fn[64,64]{1,0} %b), "
        'custom_call_target="__cublas$lt$matmul$f8"\n'
        "%d = f32[8,8]{1,0} dot(f32[8,4]{1,0} %x, f32[4,8]{1,0} %y), lhs_contracting_dims={1}"
    )
    got = hlo_gemms(hlo + "\n" + hlo.splitlines()[0].replace("%c =", "%c2 ="))
    assert got["fp8_gemm_calls"] == ["__cublas$lt$matmul$f8"] and got["dots"] == {"f32": 1}
    assert got["fp8_gemms"] == 2  # every call counted


def test_hlo_reader_counts_dots_on_two_fp8_operands_as_fp8_gemms():
    # as XLA:GPU (jax 0.11.2, H200) prints a Triton GEMM fusion's computation
    hlo = (
        "%p0 = f8e4m3fn[64,64]{1,0} parameter(0)\n%p1 = f8e5m2[64,64]{1,0} parameter(1)\n"
        "%b = bf16[64,64]{1,0} parameter(2)\n"
        "ROOT %d = f32[64,64]{1,0} dot(%p0, %p1), lhs_contracting_dims={1}\n"
        "%e = bf16[64,64]{1,0} dot(%b, %b), lhs_contracting_dims={1}"
    )
    got = hlo_gemms(hlo)
    assert got["fp8_dots"] == 1 and got["dots"] == {"f32": 1, "bf16": 1}


def test_fp8_projection_runs_its_three_matmuls_on_fp8_operands():
    import jax
    import jax.numpy as jnp

    from moe_train.selftest import checks

    probe = checks.fp8_probe("xla", "delayed", 16, 0)
    x = jnp.ones((32, 64), jnp.bfloat16)

    def fwd_bwd(x, w, dy):
        y, vjp = jax.vjp(probe, x, w)
        return y, vjp(dy)

    hlo = jax.jit(fwd_bwd).lower(x, x.T, x @ x.T).as_text(dialect="hlo")
    assert hlo_gemms(hlo)["fp8_dots"] == 3


def test_hlo_reader_finds_no_fp8_gemm_in_a_bf16_matmul():
    import jax
    import jax.numpy as jnp

    a = jnp.zeros((16, 16), jnp.bfloat16)
    text = jax.jit(lambda x, y: x @ y).lower(a, a).compile().as_text()
    assert text is not None and hlo_gemms(text)["fp8_gemm_calls"] == []


def test_compile_section_maps_every_gpu_kind_to_a_shipped_target():
    from moe_train.gpucheck import compiled
    from topology import targets

    assert compiled.target_for("NVIDIA H200") == "h200-sxm"
    assert compiled.target_for("NVIDIA H100 80GB HBM3") == "h100-sxm"
    assert compiled.target_for("NVIDIA GB200") == "gb200"
    assert compiled.target_for("cpu") is None
    assert {name for _, name in compiled.TARGETS} <= set(targets.list_targets())


def test_compile_section_passes_a_memory_field_within_its_tolerance():
    from moe_train.gpucheck import compiled

    assert compiled._compare("temp", 105, 100)["status"] == "PASS"
    assert compiled._compare("temp", 0, 0)["status"] == "PASS"
    far = compiled._compare("temp", 150, 100)
    assert far["status"] == "FAIL" and "outside 1 +- 0.1" in far["reason"]


@pytest.mark.parametrize("section", ["training", "expert_parallel"])
def test_trainer_runs_skip_with_the_reason_on_a_tpu(tmp_path, section):
    from moe_train.gpucheck import runs

    ctx = gpucheck.Context("tpu", 1, tmp_path, float("inf"), "TPU v5 lite")
    got = getattr(runs, section)(ctx)
    assert got["status"] == "SKIP" and "one process at a time" in got["reason"]
