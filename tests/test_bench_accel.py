"""``python -m moe_train.bench --accel``: the accelerator benchmark refuses a machine without an
accelerator, runs its whole code path at toy sizes on CPU (``--tiny``), sizes each expert shape
to the device's memory, and names the peak of the TPUs it runs on (``topology.peaks``)."""

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moe_train.bench import accel, accel_step
from moe_train.bench.__main__ import parse
from moe_train.model.flops import train_flops_per_token
from moe_train.moe import Routing, dropless_moe
from moe_train.moe.routings import MoEShape
from moe_train.planner.compile import plugin
from topology.peaks import device_model, peak_flops
from topology.presets import load as load_cluster

ROOT = Path(__file__).resolve().parents[1]
V5E_BYTES = 15.75 * 2**30  # a TPU v5e's bytes_limit
MIXTRAL = MoEShape(8192, 4096, 14336, 8, 2)
COMPILE_PROBLEM = plugin.version_problem(plugin.search_path())


def _bench(out: Path, *flags: str) -> subprocess.CompletedProcess:
    """``python -m moe_train.bench FLAGS --out OUT`` on the CPU, in its own process."""
    return subprocess.run(
        [sys.executable, "-m", "moe_train.bench", *flags, "--out", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=900,
        env={**os.environ, "JAX_PLATFORMS": "cpu"},
    )


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> tuple[dict, str, str]:
    """(results.json, results.md, stdout) of one ``--accel --tiny`` run on CPU."""
    out = tmp_path_factory.mktemp("accel")
    proc = _bench(out, "--accel", "--tiny")
    assert proc.returncode == 0, proc.stderr[-4000:]
    (run_dir,) = [p for p in out.iterdir() if p.is_dir()]
    return (
        json.loads((run_dir / "results.json").read_text()),
        (run_dir / "results.md").read_text(),
        proc.stdout,
    )


# ---- the command line


def test_without_an_accelerator_it_exits_2_with_one_line(tmp_path):
    proc = _bench(tmp_path, "--accel")
    assert proc.returncode == 2 and proc.stdout == ""
    assert len(proc.stderr.strip().splitlines()) == 1 and "no accelerator" in proc.stderr


def test_without_an_accelerator_it_writes_nothing(tmp_path):
    _bench(tmp_path, "--accel")
    assert list(tmp_path.iterdir()) == []


def test_gpu_is_the_same_as_accel():
    assert parse(["--gpu"]).accel


def test_tiny_needs_accel():
    with pytest.raises(SystemExit):
        parse(["--tiny"])


# ---- --accel --tiny, end to end on CPU


@pytest.mark.slow
def test_tiny_times_dense_plain_and_auto_at_every_shape(tiny):
    rows = tiny[0]["sections"]["accel"]["layer_rows"]
    timed = {(r["model"], r["variant"]) for r in rows if not r["skipped"]}
    for shape in accel.TINY.shapes:
        assert {(shape.name, v) for v in ("dense", "plain", "auto")} <= timed


@pytest.mark.slow
def test_tiny_times_every_available_backend_but_the_one_auto_is(tiny):
    rows = [r for r in tiny[0]["sections"]["accel"]["layer_rows"] if r["model"] == "mixtral-tiny"]
    auto = next(r["backend"] for r in rows if r["variant"] == "auto")
    assert auto == "tiled" and {r["variant"] for r in rows} == {"dense", "plain", "auto", "ragged_dot"}


@pytest.mark.slow
def test_tiny_layer_rows_have_ratios_and_tflops(tiny):
    for r in tiny[0]["sections"]["accel"]["layer_rows"]:
        assert r["ratio"] > 0 and r["tflops"] > 0 and r["time"]["reps"] >= 3 and r["dtype"] == "bfloat16"


@pytest.mark.slow
def test_the_auto_layers_time_goes_mostly_to_the_grouped_gemm(tiny):
    """The breakdown (``bench.profile``) of each `auto` layer: the experts' GEMMs are there."""
    for r in tiny[0]["sections"]["accel"]["layer_rows"]:
        if r["variant"] == "auto" and not r.get("skipped"):
            assert r["time_by_scope"]["by_scope"]["grouped_gemm"] > 0, r["model"]


def test_the_steps_time_is_broken_down_by_scope(tiny):
    rows = tiny[0]["sections"]["accel"]["step"]["rows"]
    by = rows["moe"]["time_by_scope"]["by_scope"]
    assert by["attention"] > 0 and by["route"] > 0 and by["grouped_gemm"] > 0


def test_the_markdown_says_where_the_time_goes(tiny):
    assert "### Where the time goes" in tiny[1] and "| step: moe |" in tiny[1]


def test_tiny_steps_the_moe_model_and_its_dense_twin(tiny):
    step = tiny[0]["sections"]["accel"]["step"]
    assert [r["tokens_per_s"] > 0 for r in step["rows"].values()] == [True, True]
    assert step["moe_over_dense_tflops"] > 0


def test_the_steps_tokens_per_second_are_of_steps_dispatched_back_to_back(tiny):
    for r in tiny[0]["sections"]["accel"]["step"]["rows"].values():
        assert r["tokens_per_s"] == pytest.approx(r["batch_size"] * r["seq_len"] / r["back_to_back_s"])


def test_the_step_table_shows_each_step_waited_for_beside_them(tiny):
    assert "| step ms | step ms, each waited for |" in tiny[1]


def test_the_step_table_says_the_model_s_depth_width_and_tokens(tiny):
    m = accel_step.configs(accel_step.TINY)["moe"]
    layers, width, batch, seq = m.model.num_layers, m.model.hidden, m.train.batch_size, m.train.seq_len
    assert f"Models: {layers} layers of width {width}, {batch} x {seq} tokens a step." in tiny[1]


@pytest.mark.slow
def test_tiny_evaluates_every_goal(tiny):
    goals = tiny[0]["sections"]["accel"]["goals"]
    assert len(goals) == 2 * len(accel.TINY.shapes) + 2
    assert all(g["met"] in (True, False) for g in goals[:-1])  # no peak for a CPU: MFU not measured
    assert goals[-1]["met"] is None


@pytest.mark.slow
def test_tiny_records_where_and_how_it_ran(tiny):
    results = tiny[0]
    assert results["environment"]["device_kind"] and results["environment"]["jax"] == jax.__version__
    assert results["command"].endswith("-m moe_train.bench --accel --tiny --out " + results["argv"][-1])
    assert results["created_utc"] and "git_commit" in results


@pytest.mark.slow
def test_tiny_prints_the_goals_table(tiny):
    assert "| goal | measured | target | met / not met |" in tiny[1] and tiny[1] in tiny[2]


@pytest.mark.slow
def test_tiny_says_what_it_does_as_it_goes(tiny):
    lines = tiny[2].splitlines()
    assert lines[0] == "running the accelerator benchmark ..."
    assert any(s.startswith("  accel: mixtral-tiny plain: ") for s in lines)


# ---- sizing to the device's memory


def test_fit_scales_t_down_in_powers_of_two_on_a_small_memory():
    shape, note = accel.fit(MIXTRAL, jnp.bfloat16, 8 * 2**30, 0.8, 256)
    assert (
        shape is not None
        and shape.tokens in (4096, 2048, 1024, 512, 256)
        and "T scaled 8192 ->" in (note or "")
    )


def test_fit_leaves_a_shape_that_fits_alone():
    assert accel.fit(MIXTRAL, jnp.bfloat16, 100 * 2**30, 0.8, 256) == (MIXTRAL, None)


def test_fit_leaves_a_shape_alone_where_the_memory_is_unknown():
    assert accel.fit(MIXTRAL, jnp.bfloat16, None, 0.8, 256) == (MIXTRAL, None)


def test_fit_refuses_a_shape_whose_weights_alone_do_not_fit():
    shape, note = accel.fit(MIXTRAL, jnp.bfloat16, 2 * 2**30, 0.8, 256)
    assert shape is None and "does not fit" in (note or "")


def test_the_issue_s_shapes_fit_a_tpu_v5e_at_full_size():
    """The issue measured all three at these T on the chip: the estimate must not halve them."""
    for spec in accel.FULL.shapes:
        assert accel.fit(spec.shape, jnp.bfloat16, V5E_BYTES, accel.FULL.memory_fraction, 256)[1] is None


# ---- rows that do not run


SMALL = accel.Shape("small", MoEShape(64, 16, 32, 4, 2), "softmax")


def test_rows_after_the_deadline_are_listed_as_skipped():
    rows = accel.shape_rows(SMALL, accel.TINY, None, deadline=0.0, say=lambda line: None)
    assert {r["skipped"] for r in rows} == {"over the run's time budget"}


@pytest.mark.slow
def test_a_variant_that_fails_is_a_row_saying_why_and_the_others_run(monkeypatch):
    def refuse(*args):
        raise RuntimeError("RESOURCE_EXHAUSTED: out of VMEM\nthe rest of a long message")

    made = accel._function
    monkeypatch.setattr(
        accel, "_function", lambda v, shape, sf: jax.jit(refuse) if v == "ragged_dot" else made(v, shape, sf)
    )
    rows = {r["variant"]: r for r in accel.shape_rows(SMALL, accel.TINY, None, 1e30, lambda line: None)}
    assert rows["ragged_dot"]["skipped"] == "failed: RuntimeError: RESOURCE_EXHAUSTED: out of VMEM"
    assert rows["auto"]["skipped"] is None and rows["auto"]["ratio"] > 0


def _fails_when_timed(after_calls: int):
    """A function that runs ``after_calls`` times, then raises as a device out of memory would."""
    calls = []

    def fn(x):
        calls.append(1)
        if len(calls) > after_calls:
            raise RuntimeError("RESOURCE_EXHAUSTED: Attempting to allocate 896.00M")
        return x + 1

    return fn


def test_a_variant_that_fails_while_timed_is_a_row_and_the_others_keep_their_timings():
    x = jnp.ones(4)
    entries = {
        ("dense", None): (jax.jit(lambda x: x * 2), (x,)),
        ("auto", "tiled"): (jax.jit(lambda x: x * 3), (x,)),
        ("plain", None): (_fails_when_timed(0), (x,)),
    }
    timings, failed = accel._timed(entries, accel.TINY)
    assert failed[("plain", None)].startswith("failed: RuntimeError: RESOURCE_EXHAUSTED")
    assert timings[("auto", "tiled")]["median_s"] > 0 and timings[("dense", None)]["median_s"] > 0


def test_models_narrows_the_shapes_run():
    from moe_train.bench.__main__ import chosen

    sizes = chosen(accel.FULL, parse(["--accel", "--models", "qwen3-30b-a3b", "--budget-s", "60"]))
    assert [s.name for s in sizes.shapes] == ["qwen3-30b-a3b"] and sizes.budget_s == 60


def test_an_unknown_model_exits_2_naming_the_valid_ones(capsys):
    from moe_train.bench.__main__ import chosen

    with pytest.raises(SystemExit) as exit_:
        chosen(accel.FULL, parse(["--accel", "--models", "mixtral"]))
    assert exit_.value.code == 2 and "choose from mixtral-8x7b, qwen3-30b-a3b" in capsys.readouterr().err


def test_an_empty_model_list_exits_2_naming_the_valid_ones(capsys):
    from moe_train.bench.__main__ import chosen

    with pytest.raises(SystemExit) as exit_:
        chosen(accel.FULL, parse(["--accel", "--models", ","]))
    assert exit_.value.code == 2 and "no model named; choose from mixtral-8x7b" in capsys.readouterr().err


def test_variants_narrows_the_layer_rows_run():
    from moe_train.bench.__main__ import chosen

    sizes = chosen(accel.FULL, parse(["--accel", "--variants", "plain,auto"]))
    assert sizes.variants == ("plain", "auto")


def test_the_chosen_variants_are_the_rows_beside_dense():
    rows = accel.shape_rows(SMALL, accel.TINY, None, deadline=0.0, say=lambda line: None, only=("auto",))
    assert [r["variant"] for r in rows] == ["dense", "auto"]


def test_an_unknown_variant_exits_2_naming_the_valid_ones(capsys):
    from moe_train.bench.__main__ import chosen

    with pytest.raises(SystemExit) as exit_:
        chosen(accel.FULL, parse(["--accel", "--variants", "auto,fast"]))
    assert (
        exit_.value.code == 2
        and "unknown fast; choose from plain, auto, megablox padded" in capsys.readouterr().err
    )


def test_variants_needs_accel():
    with pytest.raises(SystemExit):
        parse(["--variants", "auto"])


def test_models_needs_accel():
    with pytest.raises(SystemExit):
        parse(["--models", "qwen3-30b-a3b"])


# ---- the plain layer and the goals


@pytest.mark.parametrize("score_function", ["softmax", "sigmoid"])
def test_the_plain_layer_computes_the_dropless_layer(score_function):
    T, H, F, E, K = 64, 16, 32, 8, 2
    keys = jax.random.split(jax.random.key(0), 5)
    x, gate = jax.random.normal(keys[0], (T, H)), jax.random.normal(keys[1], (H, E))
    w0, w1 = (jax.random.normal(k, (E, H, F)) * H**-0.5 for k in keys[2:4])
    wo = jax.random.normal(keys[4], (E, F, H)) * F**-0.5
    bias = jnp.linspace(-0.1, 0.1, E) if score_function == "sigmoid" else None
    with jax.default_matmul_precision("highest"):
        want, _ = dropless_moe(x, gate, w0, w1, wo, Routing(K, score_function), expert_bias=bias)
        got = accel.plain_layer(x, gate, w0, w1, wo, top_k=K, score_function=score_function, expert_bias=bias)
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=1e-4)


def _row(model: str, variant: str, seconds: float, ratio: float) -> dict:
    return {
        "model": model,
        "variant": variant,
        "skipped": None,
        "tokens": 8,
        "ratio": ratio,
        "time": {"median_s": seconds},
    }


def test_a_layer_goal_is_met_at_1_5x_dense_and_faster_than_plain():
    rows = [_row("m", "dense", 1.0, 1.0), _row("m", "plain", 2.0, 2.0), _row("m", "auto", 1.5, 1.5)]
    step = {"rows": {"moe": {"skipped": "over the run's time budget"}}, "moe_over_dense_tflops": None}
    assert [g["met"] for g in accel.goals(rows, step)] == [True, True, None, None]


def test_a_layer_goal_is_not_met_slower_than_plain():
    rows = [_row("m", "dense", 1.0, 1.0), _row("m", "plain", 1.2, 1.2), _row("m", "auto", 1.4, 1.4)]
    step = {"rows": {"moe": {"skipped": None, "mfu": 0.5}}, "moe_over_dense_tflops": 0.79}
    assert [g["met"] for g in accel.goals(rows, step)] == [True, False, False, True]


# ---- the step models


def test_the_dense_twin_has_the_moe_model_s_active_flops():
    cfgs = accel_step.configs(accel_step.FULL)
    moe, twin = (train_flops_per_token(c) for c in cfgs.values())
    assert twin == pytest.approx(moe, rel=0.005)  # only the router differs: [H, 1] instead of [H, E]


def test_every_mlp_of_the_dense_twin_is_a_dense_swiglu_of_top_k_times_the_ffn():
    twin = accel_step.configs(accel_step.FULL)["dense twin"].model
    assert (twin.first_dense_layers, twin.dense_ffn) == (twin.num_layers, 4 * 512)


def test_the_full_step_model_is_the_issue_s_half_billion_parameter_moe():
    counts = accel_step.describe(accel_step.configs(accel_step.FULL)["moe"])
    assert 0.45e9 < counts["params"] < 0.55e9 and counts["experts"] == 32 and counts["seq_len"] == 2048


def test_the_large_step_model_is_two_whole_mixtral_layers():
    moe = accel_step.configs(accel_step.LARGE)["moe"]
    m, e = moe.model, moe.moe
    assert (m.hidden, m.num_layers, e.num_experts, e.top_k, e.expert_ffn) == (4096, 2, 8, 2, 14336)


def test_with_batch_replaces_the_batch_item():
    sized = accel_step.with_batch(accel_step.LARGE, 2)
    assert [o for o in sized.overrides if o.startswith("train.batch_size=")] == ["train.batch_size=2"]


H200 = load_cluster("h200-hgx")
H200_LIMIT = 0.75 * H200.gpu_memory_gib * 2**30  # XLA's bytes_limit at JAX's default memory fraction


def test_an_h200_steps_the_large_model_at_the_largest_batch_that_fits():
    model, _ = accel_step.choose(accel_step.MODELS, H200_LIMIT, H200, 0.9)
    batch = accel_step.configs(model)["moe"].train.batch_size
    assert model.preset == accel_step.LARGE.preset
    planned, doubled = (
        accel_step.planned_bytes(m, H200) for m in (model, accel_step.with_batch(model, 2 * batch))
    )
    assert planned is not None and doubled is not None
    assert planned <= 0.9 * H200_LIMIT < doubled


def test_the_chosen_model_s_note_gives_the_planner_s_figure():
    _, note = accel_step.choose(accel_step.MODELS, H200_LIMIT, H200, 0.9)
    assert note is not None and "memory planner's" in note and "fits 90%" in note


def test_a_v5e_steps_the_issue_s_model_as_it_is():
    model, note = accel_step.choose(accel_step.MODELS, V5E_BYTES, load_cluster("cpu-local"), 0.9)
    assert model == accel_step.FULL and note is not None and "do not fit" in note


def test_without_a_memory_limit_the_smallest_model_is_stepped():
    assert accel_step.choose(accel_step.MODELS, None, H200, 0.9) == (accel_step.FULL, None)


# The chosen H200 model's MoE step compiled by XLA:GPU for one H200 (no GPU needed): its peak.
H200_PEAK = """
import sys
from moe_train.planner.compile import plugin
problem = plugin.enable()
assert problem is None, problem
from jax.experimental import topologies
from moe_train.bench import accel_step
from moe_train.config import for_devices
from moe_train.parallel import sharding
from moe_train.planner.compile import lower
from topology import targets
from topology.presets import load
cluster = load("h200-hgx")
target = targets.load(cluster.gpu)
topology = topologies.get_topology_desc(target.name, "cuda", target_config=target.text, topology="1x1x1")
devices = topology.devices
model, _ = accel_step.choose(accel_step.MODELS, float(sys.argv[1]), cluster, 0.9)
mesh = sharding.make_mesh(list(devices))
with sharding.activate(mesh):
    found = lower.compile_one(for_devices(accel_step.configs(model)["moe"], 1), mesh, None, target, devices)
print(found.memory.xla_peak)
"""


@pytest.mark.skipif(COMPILE_PROBLEM is not None, reason=f"no CUDA PJRT plugin: {COMPILE_PROBLEM}")
def test_xla_gpu_fits_the_h200_s_step_model_in_its_bytes_limit():
    proc = subprocess.run(
        [sys.executable, "-c", H200_PEAK, str(H200_LIMIT)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert int(proc.stdout.split()[-1]) <= H200_LIMIT


# ---- the TPU peaks


@pytest.mark.parametrize(
    "kind,model,bf16",
    [
        ("TPU v5 lite", "TPU v5e", 197e12),
        ("TPU v5e", "TPU v5e", 197e12),
        ("TPU v5", "TPU v5p", 459e12),
        ("TPU v5p", "TPU v5p", 459e12),
        ("TPU v6 lite", "TPU v6e", 918e12),
        ("TPU v6e", "TPU v6e", 918e12),
    ],
)
def test_tpu_peaks(kind, model, bf16):
    assert (device_model(kind), peak_flops(kind, "bfloat16")) == (model, bf16)


@pytest.mark.parametrize("kind", ["TPU v5 lite", "TPU v5", "TPU v6 lite"])
def test_a_tpu_has_no_fp8_peak(kind):
    assert peak_flops(kind, "fp8") is None


def _at(row: dict, tokens: int) -> dict:
    return row | {"tokens": tokens}


def test_auto_over_plain_is_compared_at_the_largest_t_both_ran():
    rows = [
        _row("m", "dense", 1.0, 1.0),
        _row("m", "auto", 1.4, 1.4),
        _row("m", "plain", 0, 0) | {"skipped": "failed: RESOURCE_EXHAUSTED"},
        _at(_row("m", "dense", 0.5, 1.0), 4),
        _at(_row("m", "plain", 1.0, 2.0), 4),
        _at(_row("m", "auto", 0.8, 1.6), 4),
    ]
    step = {"rows": {"moe": {"skipped": "over the run's time budget"}}, "moe_over_dense_tflops": None}
    dense_goal, plain_goal = accel.goals(rows, step)[:2]
    assert (dense_goal["measured"], plain_goal["measured"]) == (1.4, 0.8) and "(T 4)" in plain_goal["goal"]


def test_a_plain_layer_out_of_memory_is_run_again_at_half_the_tokens():
    rows = [
        {"variant": "auto", "skipped": None, "tokens": SMALL.shape.tokens},
        {"variant": "plain", "skipped": "failed: JaxRuntimeError: RESOURCE_EXHAUSTED: E0101"},
    ]
    sizes = dataclasses.replace(accel.TINY, min_tokens=16)
    again = accel.halved_rows(SMALL, rows, sizes, None, 1e30, lambda line: None)
    assert {(r["variant"], r["tokens"]) for r in again} == {
        (v, SMALL.shape.tokens // 2) for v in ("dense", "plain", "auto")
    }
    assert all("plain out of device memory at T=64" in r["note"] for r in again)


def test_a_plain_layer_that_failed_otherwise_is_not_run_again():
    rows = [
        {"variant": "auto", "skipped": None, "tokens": SMALL.shape.tokens},
        {"variant": "plain", "skipped": "over the run's time budget"},
    ]
    assert accel.halved_rows(SMALL, rows, accel.TINY, None, 1e30, lambda line: None) == []
