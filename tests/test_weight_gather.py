"""``parallel.weight_gather=step`` (``moe_train.train.gather``): the weights cross the data axis
once per step, not inside the micro-batch loop, and the step is the same step."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import records, search
from jax.sharding import PartitionSpec as P

from moe_train import config
from moe_train.config import ConfigError
from moe_train.parallel import sharding
from moe_train.parallel.sharding import ep_plans
from moe_train.train import step as train
from moe_train.train.gather import StepGather, cast_in_use, without_data
from moe_train.train.loop import EXIT_OK, run
from topology import device_mesh

TOKENS = ("data", "expert_x", "expert")


def tiny(*overrides: str) -> config.Config:
    return config.build(
        "tiny",
        ["train.steps=2", "train.log_every=100", "train.batch_size=16", "train.micro_batches=2", *overrides],
    )


def test_the_copy_drops_data_from_every_dimension():
    assert without_data(P(TOKENS, None), True) == P(("expert_x", "expert"), None)
    assert without_data(P(("expert_x", "expert"), "data", None), True) == P(
        ("expert_x", "expert"), None, None
    )
    assert without_data(P(None, ("data", "expert")), True) == P(None, "expert")


def test_the_gradient_first_reduces_inside_the_group_where_a_weight_spans_both():
    # non-expert weights: split over the EP group first; expert weights: over data directly
    assert without_data(P(TOKENS, None), False) == P(("expert_x", "expert"), None)
    expert = P(("expert_x", "expert"), "data", None)
    assert without_data(expert, False) == expert


def test_matrices_are_gathered_in_the_compute_dtype_but_the_router_and_norms_stay_fp32():
    assert cast_in_use(("embed", "mlp")) and cast_in_use(("layers", "expert", "embed", "mlp"))
    assert not cast_in_use(("embed", "expert_gate"))
    assert not cast_in_use(("layers", "norm")) and not cast_in_use(("norm",))


def test_an_unknown_mode_names_the_choices():
    with pytest.raises(ConfigError, match="micro_batch, step"):
        config.validate(tiny("parallel.weight_gather=once"))


def _computations(hlo: str) -> tuple[dict[str, list[str]], str]:
    comps, cur, entry = {}, None, ""
    for line in hlo.splitlines():
        head = re.match(r"^(ENTRY )?%?([\w.\-]+) .*\{$", line)
        if head:
            cur, entry = head[2], head[2] if head[1] else entry
            comps[cur] = []
        elif cur and line.strip() == "}":
            cur = None
        elif cur:
            comps[cur].append(line)
    return comps, entry


def _reachable(comps, roots) -> set[str]:
    seen, todo = set(), list(roots)
    while todo:
        name = todo.pop()
        if name in seen or name not in comps:
            continue
        seen.add(name)
        for line in comps[name]:
            for called in re.findall(
                r"(?:calls|body|condition|to_apply|branch_computations)="
                r"\{?%?([\w.\-]+(?:, %[\w.\-]+)*)",
                line,
            ):
                todo += [c.strip("%") for c in called.split(", ")]
    return seen


def all_gathers(cfg) -> tuple[int, int]:
    """(all-gathers inside the micro-batch loop, outside it) of ``cfg``'s compiled step."""
    mesh = device_mesh.build(cfg, jax.devices()[: cfg.parallel.devices]).mesh
    with sharding.activate(mesh):
        abstract = jax.eval_shape(lambda: train.init_state(cfg, mesh))
        shardings = train.state_shardings(cfg, mesh, abstract)
        plan = ep_plans(cfg, mesh)[-1]  # the worst-case bucket: no overflow flag to take
        step = train.make_train_step(cfg, mesh, train.StepCounter(), shardings, plan)
        batch = jax.ShapeDtypeStruct((cfg.train.batch_size, cfg.train.seq_len + 1), jnp.int32)
        comps, entry = _computations(step.lower(abstract, batch).compile().as_text())
    bodies = [search(r"body=%?([\w.\-]+)", line)[1] for line in comps[entry] if " while(" in line]
    assert len(bodies) == 1, bodies  # the accumulation scan
    inside = _reachable(comps, bodies)
    count = lambda names: sum(
        bool(re.search(r" all-gather(-start)?\(", line))  # noqa: E731
        for n in names
        for line in comps[n]
    )
    return count(inside), count(_reachable(comps, [entry]) - inside)


def test_with_data_parallelism_alone_no_weight_is_gathered_inside_the_micro_batch_loop():
    inside, outside = all_gathers(
        tiny(
            "parallel.devices=8",
            "model.num_layers=2",
            "precision.compute=bf16",
            "parallel.weight_gather=step",
        )
    )
    assert inside == 0 and outside > 0, (inside, outside)


def test_under_expert_parallelism_the_data_axis_gathers_leave_the_loop():
    # bf16: under fp32 XLA:CPU hoists micro_batch mode's gathers out of the loop by itself
    ep = ("parallel.devices=8", "parallel.ep=2", "model.num_layers=2", "precision.compute=bf16")
    per_mb = all_gathers(tiny(*ep, "parallel.weight_gather=micro_batch"))
    once = all_gathers(tiny(*ep, "parallel.weight_gather=step"))
    assert once[0] < per_mb[0] and once[1] > per_mb[1], (per_mb, once)


def train_both(tmp_path, *overrides: str) -> dict[str, list[dict]]:
    recs = {}
    for mode in ("micro_batch", "step"):
        cfg = tiny(*overrides, f"parallel.weight_gather={mode}")
        assert run(cfg, tmp_path / mode, log=lambda s: None) == EXIT_OK
        recs[mode] = records(tmp_path / mode)
    return recs


@pytest.mark.slow
def test_fp32_steps_equal_gathering_per_micro_batch(tmp_path):
    """Same values in, same sums: fp32 losses and gradient norms agree to rounding. (4
    devices: on 8 fake devices over 2 cores XLA:CPU's collective rendezvous can stall a
    step-mode run; the compiled structure on 8 is checked above.)"""
    recs = train_both(tmp_path, "parallel.devices=4", "parallel.ep=2")
    for key in ("loss", "grad_norm"):
        np.testing.assert_allclose(
            [r[key] for r in recs["step"]], [r[key] for r in recs["micro_batch"]], rtol=1e-6
        )


@pytest.mark.slow
def test_bf16_steps_stay_within_the_reduction_precision(tmp_path):
    """bf16 matmuls on the same bf16 weights; gathering per micro-batch reduces the gradient
    in bf16, once per step in fp32: they differ by bf16 rounding of the sums only."""
    recs = train_both(tmp_path, "parallel.devices=4", "parallel.ep=2", "precision.compute=bf16")
    np.testing.assert_allclose(
        [r["loss"] for r in recs["step"]], [r["loss"] for r in recs["micro_batch"]], rtol=1e-3
    )
    np.testing.assert_allclose(
        [r["grad_norm"] for r in recs["step"]], [r["grad_norm"] for r in recs["micro_batch"]], rtol=2e-2
    )


def test_a_bf16_copy_casts_the_matrices_and_keeps_the_router_and_norms_fp32():
    cfg = config.build("deepseek-v3-tiny", ["precision.compute=bf16"])
    boxed = train.boxed_params(cfg)
    mesh = device_mesh.build(cfg, jax.devices()[:1]).mesh
    copy = StepGather.of(boxed, sharding.Sharding.of(mesh, cfg.model).params(boxed), jnp.bfloat16)
    dtypes = {
        jax.tree_util.keystr(path): dt for path, dt in jax.tree_util.tree_flatten_with_path(copy.dtype)[0]
    }
    fp32 = {k for k, dt in dtypes.items() if dt == jnp.float32}
    assert fp32 and all("gate" in k or "norm" in k or "scale" in k for k in fp32), fp32
    assert any("'gate'" in k for k in fp32)
    assert {dtypes[k] for k in dtypes if "wi_0" in k or "kv_b" in k} == {jnp.dtype(jnp.bfloat16)}
