"""Scanned layers (``model.scan_layers``): the stacked layout of every layer collection, one
compiled body whatever the depth, the conversion to and from the looped layout (same losses,
gradients and fp8 state), weight decay and bias updates in both layouts, and checkpoints
that resume across layouts.

Letter key: B batch, S sequence, L layers of a group, E experts.
"""

import re
from pathlib import Path

import flax.linen as nn
import jax
import numpy as np
import optax
import pytest
from helpers import QUIET, call, losses

from moe_train import config
from moe_train.checkpoints import checkpoint
from moe_train.checkpoints.checkpoint import Checkpointer
from moe_train.config import ConfigError
from moe_train.model.precision import FP8_COLLECTION
from moe_train.model.settings import model_settings
from moe_train.model.transformer import Transformer, to_looped, to_scanned
from moe_train.parallel import sharding
from moe_train.train import step as train
from moe_train.train.loop import EXIT_OK, run
from topology import device_mesh

# a dense group of 1 and an MoE group of 2, sigmoid routing with a live expert bias
SHAPE = ["model.num_layers=3", "model.first_dense_layers=1", "moe.score_function=sigmoid"]


def build(scan: bool, *overrides: str) -> config.Config:
    return config.build("tiny", [f"model.scan_layers={str(scan).lower()}", *SHAPE, *overrides])


def tokens(batch: int = 2, seq: int = 33):
    return jax.random.randint(jax.random.key(1), (batch, seq), 0, 256)


def init(cfg: config.Config) -> dict:
    return nn.unbox(jax.jit(Transformer(model_settings(cfg)).init)(jax.random.key(0), tokens()[:, :-1]))


def loss_and_grads(cfg: config.Config, variables: dict):
    """(loss, MoE stats), (d loss / d params, new fp8 state) of ``variables`` on ``tokens()``."""

    def loss(params, fp8, rest, t_BS):
        extra = {FP8_COLLECTION: fp8} if fp8 else {}
        variables = {"params": params, **rest, **extra}
        logits_BSV, stats = call(Transformer(model_settings(cfg)), variables, t_BS[:, :-1])
        ce = optax.softmax_cross_entropy_with_integer_labels(logits_BSV, t_BS[:, 1:]).mean()
        return ce + 0.01 * stats.aux_loss.mean(), stats

    fn = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))
    return fn(
        variables["params"],
        variables.get(FP8_COLLECTION, {}),
        {"moe_state": variables["moe_state"]},
        tokens(),
    )


def with_bias(variables: dict) -> dict:
    """A nonzero expert bias, so the test covers moe_state's layout too."""
    bias_LE = jax.random.normal(jax.random.key(2), (2, 8)) * 0.1
    return {**variables, "moe_state": {"moe_layers": {"moe": {"expert_bias": bias_LE}}}}


def assert_trees_close(got, want, rtol=1e-5, atol=1e-7):
    assert jax.tree.structure(got) == jax.tree.structure(want)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=rtol, atol=atol), got, want)


# ----------------------------------------------------------------------------- layout


def test_every_layer_collection_is_stacked_per_group():
    variables = jax.eval_shape(lambda: init(build(True, "precision.compute=fp8")))
    assert set(variables["params"]) == {"embed", "dense_layers", "moe_layers", "final_norm", "lm_head"}
    for collection in ("params", FP8_COLLECTION):
        for group, n in (("dense_layers", 1), ("moe_layers", 2)):
            leaves = jax.tree.leaves(variables[collection][group])
            assert leaves and all(x.shape[0] == n for x in leaves), (collection, group)
    assert variables["moe_state"]["moe_layers"]["moe"]["expert_bias"].shape == (2, 8)


def test_parameters_carry_the_layers_axis_name():
    boxed = jax.eval_shape(lambda: Transformer(model_settings(build(True))).init(jax.random.key(0), tokens()))
    names = [
        x.names
        for x in jax.tree.leaves(
            boxed["params"]["moe_layers"], is_leaf=lambda x: isinstance(x, nn.Partitioned)
        )
    ]
    assert names and all(n[0] == "layers" for n in names)
    wi_0 = boxed["params"]["moe_layers"]["moe"]["wi_0"]
    assert wi_0.names == ("layers", "expert", "embed", "mlp")


@pytest.mark.parametrize("dense,groups", [(0, {"moe_layers"}), (3, {"dense_layers"})])
def test_a_group_of_no_layers_does_not_exist(dense, groups):
    cfg = build(True, f"model.first_dense_layers={dense}")
    variables = jax.eval_shape(lambda: init(cfg))
    assert {k for k in variables["params"] if k.endswith("_layers")} == groups
    assert bool(variables.get("moe_state")) == ("moe_layers" in groups)


def _dots(cfg: config.Config) -> int:
    variables = jax.eval_shape(lambda: init(cfg))
    text = jax.jit(Transformer(model_settings(cfg)).apply).lower(variables, tokens()[:, :-1]).as_text()
    return len(re.findall(r"stablehlo\.dot_general", text))


def test_a_scan_lowers_one_block_body_whatever_the_depth():
    scan = [_dots(build(True, f"model.num_layers={n}")) for n in (3, 7)]
    loop = [_dots(build(False, f"model.num_layers={n}")) for n in (3, 7)]
    assert scan[0] == scan[1] and loop[1] > loop[0] > scan[0], (scan, loop)


# ----------------------------------------------------------------------------- conversion


def test_both_layouts_give_the_same_loss_stats_and_gradients():
    cfg = {scan: build(scan) for scan in (True, False)}
    scanned = with_bias(init(cfg[True]))
    (loss_s, stats_s), (grads_s, _) = loss_and_grads(cfg[True], scanned)
    looped = to_looped(scanned, cfg[True].model)
    (loss_l, stats_l), (grads_l, _) = loss_and_grads(cfg[False], looped)
    np.testing.assert_allclose(loss_l, loss_s, rtol=1e-6)
    np.testing.assert_array_equal(stats_l.tokens_per_expert, stats_s.tokens_per_expert)
    assert stats_s.tokens_per_expert.shape == (2, 8)
    assert_trees_close(to_looped(grads_s, cfg[True].model), grads_l)


def test_fp8_scaling_state_follows_its_layer_in_both_layouts():
    """Same weights and fp8 state: every weight's new amax (a function of that layer's weights
    alone) lands in the same layer's state bitwise. The loss agrees to bf16 rounding only:
    XLA fuses the two bf16 programs differently (measured 0.2%; bf16 alone 0.15%, while
    fp32 is bitwise equal)."""
    cfg = {scan: build(scan, "precision.compute=fp8") for scan in (True, False)}
    scanned = init(cfg[True])
    (loss_s, _), (_, fp8_s) = loss_and_grads(cfg[True], scanned)
    (loss_l, _), (_, fp8_l) = loss_and_grads(cfg[False], to_looped(scanned, cfg[True].model))
    np.testing.assert_allclose(loss_l, loss_s, rtol=1e-2)
    got = dict(jax.tree_util.tree_leaves_with_path(to_looped(fp8_s, cfg[True].model)))
    kernels = [
        (p, h)
        for p, h in jax.tree_util.tree_leaves_with_path(fp8_l)
        if "kernel" in jax.tree_util.keystr(p) and p[-1].key == "amax_history"
    ]
    assert len(kernels) == 3 * (4 + 3)  # 3 layers: q, k, v, o and the MLP's or experts' 3
    for path, h_A in kernels:
        assert h_A[0] > 0
        np.testing.assert_array_equal(got[path], h_A, err_msg=jax.tree_util.keystr(path))


def _state(cfg: config.Config, abstract: bool = False) -> train.TrainState:
    mesh = device_mesh.build(cfg, jax.devices()[:1]).mesh
    with sharding.activate(mesh):
        if abstract:
            return jax.eval_shape(lambda: train.init_state(cfg, mesh))
        return train.init_state(cfg, mesh)


def test_a_whole_train_state_converts_to_the_looped_shapes_and_back_bitwise():
    cfg = build(True, "precision.compute=fp8", "moe.bias_update_rate=0.01")
    state = _state(cfg)
    looped = to_looped(state, cfg.model)
    want = _state(build(False, "precision.compute=fp8", "moe.bias_update_rate=0.01"), True)
    shapes = lambda t: jax.tree.map(lambda x: (x.shape, x.dtype), t)  # noqa: E731
    assert shapes(looped) == shapes(want)  # params, Adam moments, moe_state, fp8 state
    jax.tree.map(np.testing.assert_array_equal, to_scanned(looped, cfg.model), state)


def test_weight_decay_skips_norm_scales_in_both_layouts():
    cfg = build(True)
    params = init(cfg)["params"]
    mask = train._decay_mask(params)
    assert not mask["moe_layers"]["attn_norm"]["scale"] and mask["moe_layers"]["attn"]["q"]
    assert to_looped(mask, cfg.model, take=lambda m, _: m) == train._decay_mask(to_looped(params, cfg.model))


def test_the_bias_update_is_the_same_in_both_layouts():
    cfg = build(True)
    state = with_bias(init(cfg))["moe_state"]
    load_LE = jax.random.randint(jax.random.key(3), (2, 8), 0, 100)
    scanned = train.update_bias(state, load_LE, rate=0.01)
    looped = train.update_bias(to_looped(state, cfg.model), load_LE, rate=0.01)
    jax.tree.map(np.testing.assert_array_equal, to_looped(scanned, cfg.model), looped)
    assert not np.array_equal(
        scanned["moe_layers"]["moe"]["expert_bias"], state["moe_layers"]["moe"]["expert_bias"]
    )


# ----------------------------------------------------------------------------- checkpoints


def run_cfg(scan: bool, steps: int) -> config.Config:
    # decay_steps fixed: the schedule (hence every step) does not depend on train.steps
    return build(
        scan,
        f"train.steps={steps}",
        "parallel.devices=1",
        "train.log_every=100",
        "train.telemetry_interval_s=0",
        "train.async_checkpoint=false",
        "optim.decay_steps=10",
        "moe.bias_update_rate=0.01",
    )


def saved_params(out: Path, step: int) -> dict:
    ck = Checkpointer(out, keep=3, use_async=False)
    state = ck.restore_saved(step)
    ck.close()
    return jax.tree.map(np.asarray, {k: state[k] for k in ("params", "moe_state")})


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> dict[bool, Path]:
    """Three steps in each layout, never switched."""
    outs = {}
    for scan in (True, False):
        outs[scan] = tmp_path_factory.mktemp(f"scan_{scan}")
        assert run(run_cfg(scan, 3), outs[scan], **QUIET) == EXIT_OK
    return outs


@pytest.mark.parametrize("first", [False, True], ids=["loop-then-scan", "scan-then-loop"])
def test_a_checkpoint_resumes_in_the_other_layout_as_if_not_switched(tmp_path, uninterrupted, first):
    assert run(run_cfg(first, 2), tmp_path, **QUIET) == EXIT_OK
    lines = []
    assert run(run_cfg(not first, 3), tmp_path, log=lines.append) == EXIT_OK
    assert any("resumed from" in line and "(step 2)" in line for line in lines)
    ref = uninterrupted[first]
    np.testing.assert_allclose(losses(tmp_path), losses(ref), rtol=1e-5)
    m = run_cfg(True, 3).model
    got, want = saved_params(tmp_path, 3), saved_params(ref, 3)
    convert = to_scanned if first else to_looped  # the resumed layout to the reference
    assert_trees_close(jax.tree.map(np.asarray, convert(got, m)), want, rtol=1e-4, atol=1e-6)


def test_a_checkpoint_from_before_scanned_layers_resumes_in_a_scanned_run(tmp_path, uninterrupted):
    """Earlier releases wrote looped layers and had no model.scan_layers / attention keys."""
    first, old = tmp_path / "first", tmp_path / "old"
    assert run(run_cfg(False, 2), first, **QUIET) == EXIT_OK
    ck = Checkpointer(first, keep=3, use_async=False)
    state, meta = ck.restore_saved(2), ck.read_meta(2)
    ck.close()
    for key in ("scan_layers", "attention", "attention_block"):
        del meta["config"]["model"][key]
    ck = Checkpointer(old, keep=3, use_async=False)
    ck.save(2, state, meta)
    ck.close()
    assert run(run_cfg(True, 3), old, **QUIET) == EXIT_OK
    np.testing.assert_allclose(losses(old), losses(uninterrupted[False])[2:], rtol=1e-5)


def test_only_state_changing_model_fields_are_structural(tmp_path):
    saved = config.to_dict(run_cfg(False, 3))
    for setting in ("model.scan_layers=true", "model.attention=chunked", "model.attention_block=128"):
        checkpoint.check_compatible(saved, config.build("tiny", [*SHAPE, setting]), tmp_path)
    with pytest.raises(ConfigError, match=r"model.num_heads=4 \(checkpoint\) vs 8"):
        checkpoint.check_compatible(saved, config.build("tiny", [*SHAPE, "model.num_heads=8"]), tmp_path)
