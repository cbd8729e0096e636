"""Activation checkpointing: same results under every policy (to fp32 rounding), less compiled
memory, and the ``moe`` policy never repeats an all-to-all in the backward pass."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moe_train import config
from moe_train.config import ConfigError
from moe_train.model import remat
from moe_train.model.transformer import to_looped
from moe_train.parallel import sharding
from moe_train.parallel.sharding import ep_plans
from moe_train.train import step as train
from topology import device_mesh

# Big enough that activations, not parameters, dominate the compiled temp memory.
SHAPE = ["train.batch_size=8", "train.seq_len=128", "model.num_layers=3"]


def _step(cfg, devices=1):
    """(jitted step, state, batch, counter) for ``cfg`` on ``devices`` CPU devices."""
    mesh = device_mesh.build(cfg, jax.devices()[:devices]).mesh
    with sharding.activate(mesh):
        state = train.init_state(cfg, mesh)
        plans = ep_plans(cfg, mesh)
        counter = train.StepCounter()
        step = train.make_train_step(cfg, mesh, counter, jax.tree.map(lambda x: x.sharding, state), plans[-1])
    rng = np.random.default_rng(0)
    batch = jnp.asarray(rng.integers(0, 256, (cfg.train.batch_size, cfg.train.seq_len + 1)), jnp.int32)
    return step, state, batch, counter, mesh


@pytest.fixture(scope="module")
def one_step():
    """policy -> (param paths, metrics, new params, CompiledMemory) after one step."""
    out = {}
    for policy in remat.POLICIES:
        cfg = config.build("tiny", ["parallel.devices=1", f"train.remat={policy}", *SHAPE])
        step, state, batch, counter, mesh = _step(cfg)
        paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(state.params)]
        with sharding.activate(mesh):
            memory = train.compiled_memory(step, state, batch)
            new, metrics = step(state, batch)
        out[policy] = (paths, jax.device_get(metrics), jax.device_get(new.params), memory, counter.traces)
    return out


def test_unknown_policy_lists_choices():
    with pytest.raises(ConfigError, match="train.remat='some'.*none, full, matmuls, moe"):
        config.build("tiny", ["train.remat=some"])


def test_every_policy_gives_the_same_parameters_losses_and_gradients(one_step):
    paths, metrics, params, _, _ = one_step["none"]
    for policy in ("full", "matmuls", "moe"):
        p_paths, p_metrics, p_params, _, _ = one_step[policy]
        assert p_paths == paths, "remat must keep parameter paths (checkpoints resume)"
        for key in ("loss", "total_loss", "aux_loss", "z_loss", "grad_norm"):
            np.testing.assert_allclose(p_metrics[key], metrics[key], rtol=1e-6, err_msg=policy)
        np.testing.assert_array_equal(p_metrics["tokens_per_expert"], metrics["tokens_per_expert"])
        for a, b in zip(jax.tree.leaves(p_params), jax.tree.leaves(params)):
            # one AdamW step from the same state: equal updates mean equal gradients, up to
            # fp32 rounding where XLA fuses the recomputation differently
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7, err_msg=policy)


def test_the_looped_layout_takes_the_same_step_under_full_remat(one_step):
    """scan_layers=false (remat with CSE barriers, blocks ``layer_{i}``) from the scanned
    run's initial weights: the same step as the scanned run without remat."""
    cfg = config.build("tiny", ["parallel.devices=1", "train.remat=full", "model.scan_layers=false", *SHAPE])
    step, looped, batch, _, mesh = _step(cfg)
    with sharding.activate(mesh):
        scanned = train.init_state(config.build("tiny", ["parallel.devices=1", *SHAPE]), mesh)
        state = jax.device_put(to_looped(scanned, cfg.model), jax.tree.map(lambda x: x.sharding, looped))
        new, metrics = jax.device_get(step(state, batch))
    _, want, want_params, _, _ = one_step["none"]
    for key in ("loss", "total_loss", "aux_loss", "z_loss", "grad_norm"):
        np.testing.assert_allclose(metrics[key], want[key], rtol=1e-6, err_msg=key)
    for a, b in zip(jax.tree.leaves(new.params), jax.tree.leaves(to_looped(want_params, cfg.model))):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)


def test_remat_lowers_the_compiled_temp_memory(one_step):
    temp = {p: one_step[p][3].temp for p in remat.POLICIES}
    assert temp["full"] < 0.75 * temp["none"], temp
    assert temp["matmuls"] < 0.75 * temp["none"], temp
    assert temp["moe"] < temp["none"], temp
    assert all(one_step[p][3].argument == one_step["none"][3].argument for p in remat.POLICIES)


def test_compiled_memory_reuses_the_executable(one_step):
    for policy in remat.POLICIES:
        memory, traces = one_step[policy][3], one_step[policy][4]
        assert traces == 1, "compiled_memory must not retrace the step"
        assert memory.peak == memory.argument + memory.temp + memory.output - memory.alias
        assert set(memory.metrics()) >= {"compiled_peak_bytes", "compiled_temp_bytes"}
        assert "GiB" in memory.line()


def _all_to_alls(policy: str, rows: bool = False) -> int:
    """All-to-alls in the lowered step of the tiny model on EP 8 (``rows``: only those of
    token rows, [*, H])."""
    cfg = config.build(
        "tiny", ["parallel.devices=8", "parallel.ep=8", "moe.dispatcher=a2a", f"train.remat={policy}"]
    )
    mesh = device_mesh.build(cfg, jax.devices()[:8]).mesh
    with sharding.activate(mesh):
        abstract = jax.eval_shape(lambda: train.init_state(cfg, mesh))
        shardings = train.state_shardings(cfg, mesh, abstract)
        step = train.make_train_step(cfg, mesh, train.StepCounter(), shardings, ep_plans(cfg, mesh)[0])
        batch = jax.ShapeDtypeStruct((cfg.train.batch_size, cfg.train.seq_len + 1), jnp.int32)
        hold = jax.ShapeDtypeStruct((), jnp.bool_)  # the first plan is a capacity bucket
        text = step.lower(abstract, batch, hold).as_text()
    shape = rf"\(tensor<\d+x{cfg.model.hidden}x" if rows else ""
    return len(re.findall(rf"all_to_all.*{shape}", text))


def test_moe_policy_repeats_no_all_to_all_in_the_backward_pass():
    none, moe, full = (_all_to_alls(p) for p in ("none", "moe", "full"))
    assert none > 0
    assert moe == none, "remat=moe must keep the MoE exchange's results"
    assert full > none, "remat=full recomputes the exchange"


def test_full_remat_repeats_only_the_dispatch_of_the_rows():
    # per MoE layer: dispatch, combine and their transposes (4); remat=full adds the
    # dispatch again, not the combine (the experts weigh their rows, so the combine is linear)
    none, full = (_all_to_alls(p, rows=True) for p in ("none", "full"))
    assert none > 0
    assert full * 4 == none * 5


def test_cpu_compiles_with_barriers_kept_only_under_remat():
    assert remat.compiler_options("none", "cpu") is None
    assert remat.compiler_options("full", "gpu") is None
    assert remat.compiler_options("moe", "cpu") == {"xla_disable_hlo_passes": "cse_barrier_expander"}
    with pytest.raises(ValueError, match="choose one of none, full, matmuls, moe"):
        remat.block_policy("all")
