"""The step-time prediction of ``make plan`` (``moe_train.planner.steptime``, ``moe_train.planner.compute``):
the FLOP split adds up, each term moves the way its input says, the plan prints it with the
published figure, and a bad compute file is one line, exit 2."""

from __future__ import annotations

import dataclasses
import json
import math
import re
import subprocess
import tomllib
from pathlib import Path

import pytest
from helpers import run_module, toml_key

from moe_train import config
from moe_train.model import flops
from moe_train.planner import compute, steptime
from moe_train.planner.ep_plan import make_plan
from topology import presets

V3 = ("gb200-nvl72", 64, "deepseek-v3", 64)


def plan(*overrides: str, job=V3, **kw):
    return make_plan(*job, overrides=tuple(overrides), **kw)


def predicted(*overrides: str, job=V3, **kw) -> steptime.StepTime:
    """The plan's predicted step (there is one: the compute is not fp32)."""
    st = plan(*overrides, job=job, **kw).step
    assert st is not None
    return st


def cli(*args: str) -> subprocess.CompletedProcess:
    return run_module("moe_train.planner.ep_plan", *args, timeout=120)


def test_the_flop_kinds_sum_to_the_model_flops():
    for name in ("deepseek-v3", "mixtral-8x7b", "qwen3-30b-a3b", "tiny"):
        cfg = config.load_preset(name)
        kinds = steptime.flops_by_kind(cfg)
        assert sum(kinds.values()) == pytest.approx(flops.train_flops_per_token(cfg), rel=1e-9)
        assert min(kinds.values()) >= 0


def test_the_step_is_the_sum_of_its_terms():
    st = predicted()
    parts = sum(st.compute_s.values()) + st.a2a_exposed_s + st.fsdp_exposed_s + st.optimizer_s
    assert st.step_s == pytest.approx(parts)
    assert st.tokens_per_s == pytest.approx(st.inputs["tokens_per_gpu"] / st.step_s)
    assert st.mfu == pytest.approx(st.model_tflops / st.peak_tflops)


def test_chunks_hide_their_measured_share_of_the_all_to_all():
    one, four = predicted(), predicted("moe.overlap_chunks=4")
    for st in (one, four):
        hidden = st.a2a_s - st.a2a_exposed_s
        assert 0 < hidden <= st.inputs["a2a_hidden"] * st.a2a_s * (1 + 1e-9)
    assert four.a2a_s >= one.a2a_s  # more, smaller collectives: more latency terms


@pytest.mark.parametrize("step", [False, True])
def test_the_hidden_share_is_the_measured_one_at_each_measured_chunk_count(step):
    eff = compute.load()
    for c in compute.MEASURED_CHUNKS:
        want = getattr(eff, compute.share_field(c, step))
        assert compute.a2a_hidden(eff, c, step) == pytest.approx(want)
    assert compute.a2a_hidden(eff, 16, step) == pytest.approx(
        compute.a2a_hidden(eff, 8, step)
    )  # no extrapolation


def test_a_chunk_count_between_measured_ones_interpolates_in_log2_of_the_chunks():
    eff = compute.load()
    two, four = eff.a2a_hidden_step_2chunks, eff.a2a_hidden_step_4chunks
    assert compute.a2a_hidden(eff, 3, step=True) == pytest.approx(two + (four - two) * math.log2(1.5))


def test_the_hierarchical_exchange_hides_its_measured_share_and_less_than_the_flat_one():
    eff = compute.load()
    flat = [compute.a2a_hidden(eff, c) for c in (1, 2, 4, 8)]
    hier = [compute.a2a_hidden(eff, c, hierarchical=True) for c in (1, 2, 4, 8)]
    assert hier[-1] == pytest.approx(eff.a2a_hidden_hierarchical_8chunks)
    assert all(h <= f for h, f in zip(hier, flat, strict=True))
    ratio = eff.a2a_hidden_hierarchical_8chunks / flat[-1]  # the flat curve, scaled
    assert hier == pytest.approx([f * ratio for f in flat])


def test_step_mode_hides_the_share_measured_in_step_mode():
    st = predicted("parallel.weight_gather=step", "moe.overlap_chunks=4")
    assert st.inputs["a2a_hidden"] == pytest.approx(compute.load(model="deepseek-v3").a2a_hidden_step_4chunks)


def test_a_plan_across_nvlink_domains_predicts_with_the_hierarchical_share():
    job = ("h100-dgx", 2, "qwen3-30b-a3b", 16)  # EP 16 over two 8-GPU nodes
    st = predicted("moe.overlap_chunks=8", "parallel.weight_gather=micro_batch", job=job)
    assert st.inputs["hierarchical"] is True
    assert st.inputs["a2a_hidden"] == pytest.approx(compute.load().a2a_hidden_hierarchical_8chunks)


def default_shares(tmp_path) -> str:
    """A compute file of the shipped defaults whose empty ``[model]`` table applies no model's
    own overlap shares."""
    text = compute.DEFAULTS.read_text()
    (tmp_path / "c.toml").write_text(text[: text.index("\n[model.")] + "\n[model]\n")
    return str(tmp_path / "c.toml")


def test_an_empty_model_table_applies_no_models_shares(tmp_path):
    assert compute.load(default_shares(tmp_path), model="deepseek-v3").model == ""


def chunk_rewarding_shares(tmp_path) -> str:
    """The shipped defaults (no model's own shares) with an exchange that hides 0%, 30%, 60%
    and 90% at 1, 2, 4 and 8 chunks in ``micro_batch`` mode."""
    text = Path(default_shares(tmp_path)).read_text()
    counts = ("1chunk", "2chunks", "4chunks", "8chunks")
    rewarding = "".join(
        f"a2a_hidden_{chunks} = {share}\n" for chunks, share in zip(counts, (0.0, 0.3, 0.6, 0.9), strict=True)
    )
    text = toml_key(text, "a2a_hidden", None).replace("[compute.source]", rewarding + "[compute.source]", 1)
    (tmp_path / "rewarding.toml").write_text(text)
    return str(tmp_path / "rewarding.toml")


def test_the_planner_chooses_the_chunks_that_hide_the_all_to_all(tmp_path):
    """With shares that reward chunks, the planner takes the chunk count that hides the
    most."""
    st = predicted(
        "train.micro_batch_size=0", "train.micro_batches=1", compute=chunk_rewarding_shares(tmp_path)
    )
    assert set(st.by_chunks) == set(steptime.CHUNK_CHOICES)
    assert st.best_chunks > 1 and st.by_chunks[st.best_chunks] < st.by_chunks[1]
    assert st.by_chunks[1] == pytest.approx(st.step_s)  # the preset's own moe.overlap_chunks=1


def test_fp8_dispatch_halves_the_forward_dispatch_bytes():
    bf16, fp8 = predicted("train.remat=none"), predicted("train.remat=none", "moe.dispatch_dtype=fp8")
    moved = bf16.inputs["a2a_transfer_s"] * bf16.inputs["moe_layers"]
    saved = moved * (1 - steptime.fp8_row_ratio(7168))  # one of the four all-to-alls
    assert bf16.a2a_s - fp8.a2a_s == pytest.approx(saved)
    assert fp8.inputs["fp8_dispatches"] == 1
    assert predicted("train.remat=full", "moe.dispatch_dtype=fp8").inputs["fp8_dispatches"] == 2


def test_fp8_matmuls_shorten_the_gemms_and_use_the_fp8_peak():
    bf16, fp8 = predicted(), predicted("precision.compute=fp8")
    assert fp8.compute_s["experts"] < bf16.compute_s["experts"]
    assert fp8.compute_s["scores"] == pytest.approx(bf16.compute_s["scores"])  # stays bf16
    assert (bf16.peak_tflops, fp8.peak_tflops) == (2500, 5000)


def test_fsdp_traffic_grows_with_micro_batches():
    few = predicted("train.micro_batch_size=0", "train.micro_batches=4")
    many = predicted("train.micro_batch_size=0", "train.micro_batches=8")
    assert many.fsdp_s == pytest.approx(2 * few.fsdp_s)


# docs/planning.md's DeepSeek-V3 job: weights gathered once per step, 30 micro-batches (the
# memory planner's fit), the exchange in 4 chunks, fp8 dispatch
V3_FAST = (
    "parallel.weight_gather=step",
    "train.micro_batch_size=0",
    "train.micro_batches=20",
    "moe.overlap_chunks=4",
    "moe.dispatch_dtype=fp8",
)


def test_gathering_once_per_step_moves_less_than_per_micro_batch():
    mb, step = predicted(), predicted("parallel.weight_gather=step")
    assert step.fsdp_s < mb.fsdp_s / 3  # per micro-batch: the gradient reductions, no gathers over data
    assert step.by_gather == pytest.approx({"micro_batch": mb.step_s, "step": step.step_s})


def test_step_gather_traffic_is_one_gather_plus_gradients_per_micro_batch():
    t = {
        n: predicted(
            "parallel.weight_gather=step", "train.micro_batch_size=0", f"train.micro_batches={n}"
        ).fsdp_s
        for n in (10, 20, 40)
    }
    assert t[40] - t[20] == pytest.approx(2 * (t[20] - t[10]))  # linear in n
    assert t[10] - (t[20] - t[10]) > 0  # plus the once-per-step gather


def test_a_data_parallel_size_of_one_moves_no_weights_across_groups():
    st = predicted("parallel.weight_gather=step", job=("gb200-nvl72", 16, "deepseek-v3", 64))
    dense, _ = steptime.weights(config.load_preset("deepseek-v3"))
    inside = (2 + 1) * 2 * dense * 63 / 64 / _nvlink("gb200-nvl72")  # 2 gathers, 1 reduction, bf16
    assert st.inputs["dp"] == 1
    assert st.fsdp_s == pytest.approx(st.inputs["micro_batches"] * inside)


def _nvlink(preset: str) -> float:
    c = presets.load(preset)
    return c.eta_nvlink * c.nvlink_gbps_per_gpu * 1e9


def test_fp8_dispatch_exposes_less_of_deepseek_v3s_exchange():
    """On 64 racks, bf16 and fp8 matmuls: fp8 dispatch exposes less of the exchange, and less
    communication, than bf16 rows at the same chunk count."""
    bf16_rows = (*V3_FAST[:4], "moe.dispatch_dtype=activation")
    for compute_ in ("bf16", "fp8"):
        fast = predicted(*V3_FAST, f"precision.compute={compute_}")
        same_chunks = predicted(*bf16_rows, f"precision.compute={compute_}")
        assert fast.a2a_exposed_s < same_chunks.a2a_exposed_s, compute_
        assert fast.comm_share < same_chunks.comm_share, (compute_, fast.comm_share, same_chunks.comm_share)


def test_the_chunk_count_whose_measured_share_is_highest_exposes_least_of_the_exchange():
    """The chunks' effect on the exchange is the measured one (docs/compile.md: DeepSeek-V3's
    schedule hides the most of it at 1 chunk with the Blackwell presets' flags)."""
    eff, counts = compute.load(model="deepseek-v3"), (1, 2, 4, 8)
    rows = (*V3_FAST[:3], "moe.dispatch_dtype=activation")
    exposed = {c: predicted(*rows, f"moe.overlap_chunks={c}").a2a_exposed_s for c in counts}
    shares = {c: compute.a2a_hidden(eff, c, step=True) for c in counts}
    assert min(exposed, key=exposed.__getitem__) == max(shares, key=shares.__getitem__)


def test_full_remat_recomputes_a_forward_and_its_dispatch():
    none, full = predicted("train.remat=none"), predicted("train.remat=full")
    assert full.compute_s["experts"] == pytest.approx(none.compute_s["experts"] * 4 / 3)
    assert (none.inputs["a2a_per_moe_layer"], full.inputs["a2a_per_moe_layer"]) == (4, 5)


def test_remat_recomputes_the_forward_but_gathers_each_weight_twice():
    """The recomputation's gathered weights also serve the gradient's matmuls (XLA:GPU's
    schedule of the full-depth Mixtral jobs: one all-gather per layer in the forward and one
    in the backward, docs/compile.md): full remat moves what no remat moves."""
    mb = ("train.micro_batch_size=0", "train.micro_batches=4")
    none, full = predicted(*mb, "train.remat=none"), predicted(*mb, "train.remat=full")
    assert full.fsdp_s == pytest.approx(none.fsdp_s)


def test_better_efficiency_is_a_shorter_step(tmp_path):
    text = toml_key(compute.DEFAULTS.read_text(), "gemm_efficiency", "1.0")
    (tmp_path / "c.toml").write_text(text)
    one = ("train.micro_batch_size=0", "train.micro_batches=1")  # compute-bound: FSDP hides
    assert predicted(*one, compute=str(tmp_path / "c.toml")).step_s < predicted(*one).step_s


def test_fp32_compute_has_no_prediction():
    assert plan("precision.compute=fp32").step is None


@pytest.mark.parametrize("model", [None, "deepseek-v3"])
def test_each_shipped_efficiency_says_where_it_came_from(model):
    eff = compute.load(model=model)
    assert set(eff.source) == set(compute.FIELDS) and all(eff.source.values())


def test_json_carries_every_input_and_the_anchor():
    r = cli("--preset", "gb200-nvl72", "--nodes", "64", "--model", "deepseek-v3", "--ep", "64", "--json")
    out = json.loads(r.stdout)
    st = out["step"]
    assert set(st["inputs"]["efficiency"]) == set(compute.FIELDS)
    assert {"tokens_per_s", "model_tflops", "mfu", "peak_tflops", "comm_share"} <= set(st)
    assert out["anchors"][0]["tflops_per_gpu"] == 1276


def test_human_output_prints_the_prediction_beside_the_published_figure():
    r = cli("--preset", "gb200-nvl72", "--nodes", "64", "--model", "deepseek-v3", "--ep", "64")
    assert "model TFLOP/s/GPU, MFU" in r.stdout
    assert "published: 4,912 tokens/s/GPU, 1,276" in r.stdout


def test_set_overrides_reach_the_prediction():
    r = cli(
        "--preset",
        "gb200-nvl72",
        "--nodes",
        "64",
        "--model",
        "deepseek-v3",
        "--ep",
        "64",
        "--set",
        "moe.overlap_chunks=4",
        "--json",
    )
    assert json.loads(r.stdout)["step"]["inputs"]["overlap_chunks"] == 4


def test_a_models_measured_overlap_shares_replace_the_defaults():
    base, v3 = compute.load(), compute.load(model="deepseek-v3")
    table = tomllib.loads(compute.DEFAULTS.read_text())["model"]["deepseek-v3"]
    for key, value in table.items():
        if key != "source":
            assert getattr(v3, key) == value and v3.source[key].startswith("deepseek-v3: ")
    assert v3.gemm_efficiency == base.gemm_efficiency and v3.model == "deepseek-v3"
    assert compute.load(model="mixtral-8x7b") == base  # no table: the defaults


def test_a_models_unmeasured_exchange_shares_scale_with_its_measured_ones():
    base, v3 = compute.load(), compute.load(model="deepseek-v3")
    table = tomllib.loads(compute.DEFAULTS.read_text())["model"]["deepseek-v3"]
    measured = [k for k in compute.EXCHANGE_FIELDS if k in table and getattr(base, k) > 0]
    ratio = sum(table[k] for k in measured) / sum(getattr(base, k) for k in measured)
    unmeasured = [k for k in compute.EXCHANGE_FIELDS if k not in table]
    assert "a2a_hidden_hierarchical_8chunks" in unmeasured
    for key in unmeasured:
        assert getattr(v3, key) == pytest.approx(getattr(base, key) * ratio)


def test_the_plan_uses_and_names_the_models_own_shares():
    st = predicted(*V3_FAST)
    assert st.inputs["overlap_model"] == "deepseek-v3"
    table = tomllib.loads(compute.DEFAULTS.read_text())["model"]["deepseek-v3"]
    assert (
        st.inputs["efficiency"]["fsdp_hidden_step_reduce_scatter_data_1chunk"]
        == table["fsdp_hidden_step_reduce_scatter_data_1chunk"]
    )
    r = cli("--preset", "gb200-nvl72", "--nodes", "64", "--model", "deepseek-v3", "--ep", "64")
    assert "overlap shares measured on deepseek-v3" in r.stdout


def test_a_compute_file_without_model_tables_takes_the_shipped_ones(tmp_path):
    text = compute.DEFAULTS.read_text()
    (tmp_path / "c.toml").write_text(toml_key(text[: text.index("\n[model.")], "gemm_efficiency", "0.9"))
    got = compute.load(tmp_path / "c.toml", model="deepseek-v3")
    assert got.gemm_efficiency == 0.9
    assert (
        got.fsdp_hidden_step_reduce_scatter_data_1chunk
        == compute.load(model="deepseek-v3").fsdp_hidden_step_reduce_scatter_data_1chunk
    )


@pytest.mark.parametrize(
    "edit,needle",
    [
        (
            lambda t: toml_key(t, "hbm_efficiency", "-0.9"),
            "compute.hbm_efficiency must be a number in (0, 1]",
        ),
        (lambda t: toml_key(t, "attention_efficiency", None), "missing key compute.attention_efficiency"),
        (
            lambda t: t.replace("[compute]\n", "[compute]\nflops_fudge = 2\n"),
            "unknown key compute.flops_fudge",
        ),
        (lambda t: toml_key(t, "gemm_efficiency", '"fast"'), "gemm_efficiency"),
        (lambda t: "[compute\n", "not valid TOML"),
        (
            lambda t: t.replace("[model.deepseek-v3]\n", "[model.deepseek-v3]\ngemm_efficiency = 0.5\n"),
            "unknown key model.deepseek-v3.gemm_efficiency; valid keys: fsdp_hidden_micro_batch",
        ),
        (
            lambda t: re.sub(
                r"(?m)^fsdp_hidden_step_reduce_scatter_data_1chunk = [0-9.]+$",
                "fsdp_hidden_step_reduce_scatter_data_1chunk = 1.5",
                t,
            ),
            "model.deepseek-v3.fsdp_hidden_step_reduce_scatter_data_1chunk must be a number in [0, 1]",
        ),
    ],
)
def test_a_bad_compute_file_is_one_line_exit_2(tmp_path, edit, needle):
    path = tmp_path / "c.toml"
    path.write_text(edit(compute.DEFAULTS.read_text()))
    r = cli("--preset", "h100-dgx", "--nodes", "1", "--model", "tiny", "--ep", "8", "--compute", str(path))
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and r.stdout == "" and len(lines) == 1 and needle in lines[0], r.stderr


def test_every_preset_has_its_memory_bandwidth():
    for name in presets.list_presets():
        assert presets.load(name).hbm_bytes_per_s > 0


def test_published_anchors_name_real_presets():
    found = compute.anchors("deepseek-v3", "gb200-nvl72") + compute.anchors("qwen3-30b-a3b", "h100-dgx")
    assert len(found) == 2
    for a in found:
        assert a.preset in presets.list_presets() and a.model in config.list_presets()
        assert dataclasses.asdict(a)["source"]


def test_each_step_mode_fsdp_part_has_its_own_measured_share():
    parts = predicted(*V3_FAST).inputs["fsdp_parts"]
    assert tuple(parts) == steptime.STEP_PARTS
    assert all(f"fsdp_hidden_step_{p}_{c}" in compute.FIELDS for p in parts for c in ("1chunk", "8chunks"))


def test_the_step_mode_parts_add_up_to_the_fsdp_time():
    st = predicted(*V3_FAST)
    assert sum(st.inputs["fsdp_parts"].values()) == pytest.approx(st.fsdp_s)
