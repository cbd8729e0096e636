"""Multi-token prediction: the shifted ids and labels, the loss against a by-hand composition
of the report's equations (21-25), the weight schedule, the MTP layer's stats and expert bias,
and the metrics a run records."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import records

from moe_train import config
from moe_train.model import mtp
from moe_train.model.settings import model_settings
from moe_train.model.transformer import Block, Transformer
from moe_train.train import step as train
from moe_train.train.loop import EXIT_OK, run

B, S = 2, 16


def cfg_of(*extra):
    return config.build("deepseek-v3-tiny", ["model.scan_layers=false", "parallel.devices=1", *extra])


def setup(cfg, seed=0):
    tokens = jnp.zeros((1, S), jnp.int32)
    variables = Transformer(model_settings(cfg)).init(jax.random.key(seed), tokens)
    batch = jnp.asarray(np.random.default_rng(seed).integers(0, 256, (B, S + 1)), jnp.int32)
    return nn.unbox(variables["params"]), variables["moe_state"], batch


def test_shifted_ids_and_labels():
    batch = jnp.arange(10, 16)[None]  # tokens t_0..t_5: S = 5 positions
    ids, labels = mtp.shifted(batch, 2)
    np.testing.assert_array_equal(ids[0, 0], [11, 12, 13, 14, 15])  # depth 1 reads t_{i+1}
    np.testing.assert_array_equal(labels[0, 0], [12, 13, 14, 15, -1])  # and predicts t_{i+2}
    np.testing.assert_array_equal(ids[1, 0], [12, 13, 14, 15, 0])  # depth 2: t_{i+2}
    np.testing.assert_array_equal(labels[1, 0], [13, 14, 15, -1, -1])  # predicts t_{i+3}


def test_weight_schedule_switches_at_the_late_step():
    m = cfg_of("model.mtp_loss_weight=0.3", "model.mtp_loss_weight_late=0.1", "model.mtp_late_step=5").model
    assert [float(mtp.mtp_weight(m, jnp.int32(s))) for s in (0, 4, 5, 9)] == pytest.approx(
        [0.3, 0.3, 0.1, 0.1]
    )
    assert float(mtp.mtp_weight(cfg_of().model, jnp.int32(10**6))) == pytest.approx(0.3)


def rms(x, scale, eps):
    return x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + eps) * scale


def reference_mtp_loss(cfg, params, moe_state, batch):
    """Eqs. 21-25 by hand on the looped layout: h^0 from the main blocks (before the final
    norm), h'_i = M [RMSNorm(Emb(t_{i+1})); RMSNorm(h^0_i)], one block, the shared head."""
    m = cfg.model
    x = params["embed"][batch[:, :-1]]
    for i in range(m.num_layers):
        name = f"layer_{i}"
        x, _ = Block(model_settings(cfg), dense=i < m.first_dense_layers).apply(
            {"params": params[name], "moe_state": moe_state.get(name, {})}, x
        )
    p = params["mtp_0"]
    emb = params["embed"][batch[:, 1:]]  # Emb(t_{i+1}) at position i
    h = (
        jnp.concatenate(
            [rms(emb, p["enorm"]["scale"], m.norm_eps), rms(x, p["hnorm"]["scale"], m.norm_eps)], -1
        )
        @ p["eh_proj"]
    )
    h, _ = Block(model_settings(cfg), dense=False).apply(
        {"params": p["block"], "moe_state": moe_state["mtp_0"]["block"]}, h
    )
    logits = rms(h, p["norm"]["scale"], m.norm_eps) @ params["lm_head"]
    logp = jax.nn.log_softmax(logits[:, :-1], -1)  # position i predicts t_{i+2}: S - 1 of them
    return -jnp.mean(jnp.take_along_axis(logp, batch[:, 2:, None], -1))


def test_mtp_loss_matches_the_equations():
    cfg = cfg_of()
    params, moe_state, batch = setup(cfg)
    _, aux = train._loss_fn(
        params, {}, moe_state, batch, Transformer(model_settings(cfg)), cfg, mtp_weight=0.3
    )
    np.testing.assert_allclose(aux["mtp"], reference_mtp_loss(cfg, params, moe_state, batch), rtol=1e-5)


def test_total_adds_the_weighted_mtp_loss_and_loss_stays_next_token():
    cfg = cfg_of()
    params, moe_state, batch = setup(cfg)
    total, aux = train._loss_fn(
        params, {}, moe_state, batch, Transformer(model_settings(cfg)), cfg, mtp_weight=0.25
    )
    e = cfg.moe
    rest = e.aux_loss_coef * aux["aux"] + e.seq_aux_loss_coef * aux["seq_aux"] + e.z_loss_coef * aux["z"]
    np.testing.assert_allclose(total, aux["ce"] + 0.25 * aux["mtp"] + rest, rtol=1e-6)
    plain = cfg_of("model.mtp_depth=0")  # the same main model without its MTP module
    _, plain_aux = train._loss_fn(
        {k: v for k, v in params.items() if k != "mtp_0"},
        {},
        {k: v for k, v in moe_state.items() if k != "mtp_0"},
        batch,
        Transformer(model_settings(plain)),
        plain,
    )
    np.testing.assert_allclose(aux["ce"], plain_aux["ce"], rtol=1e-6)


def test_a_zero_weight_leaves_the_mtp_module_without_gradient_from_the_loss():
    cfg = cfg_of("moe.seq_aux_loss_coef=0")  # no balance loss either: only the weighted MTP CE
    params, moe_state, batch = setup(cfg)
    grads = jax.grad(
        lambda p: train._loss_fn(
            p, {}, moe_state, batch, Transformer(model_settings(cfg)), cfg, mtp_weight=0.0
        )[0]
    )(params)
    assert all(float(jnp.abs(g).max()) == 0.0 for g in jax.tree.leaves(grads["mtp_0"]))
    grads = jax.grad(
        lambda p: train._loss_fn(
            p, {}, moe_state, batch, Transformer(model_settings(cfg)), cfg, mtp_weight=0.3
        )[0]
    )(params)
    assert float(jnp.abs(grads["mtp_0"]["eh_proj"]).max()) > 0


def test_stats_hold_the_mtp_block_after_the_main_moe_layers():
    cfg = cfg_of()
    params, moe_state, batch = setup(cfg)
    _, aux = train._loss_fn(params, {}, moe_state, batch, Transformer(model_settings(cfg)), cfg)
    loads = np.asarray(aux["stats"].tokens_per_expert)
    assert loads.shape == (2 + 1, 8)  # 2 MoE layers of the main model, then the MTP block
    assert (loads.sum(-1) == B * S * cfg.moe.top_k).all()


@pytest.mark.parametrize("scan", [True, False])
def test_expert_bias_update_reaches_the_mtp_block(scan):
    E = 4
    main = (
        {"moe_layers": {"moe": {"expert_bias": jnp.zeros((2, E))}}}
        if scan
        else {f"layer_{i}": {"moe": {"expert_bias": jnp.zeros(E)}} for i in (1, 2)}
    )
    state = {**main, "mtp_0": {"block": {"moe": {"expert_bias": jnp.zeros(E)}}}}
    loads = jnp.asarray([[4, 0, 0, 0], [0, 4, 0, 0], [0, 0, 0, 4]])  # last row: the MTP block
    new = train.update_bias(state, loads, 0.5)
    np.testing.assert_array_equal(new["mtp_0"]["block"]["moe"]["expert_bias"], [0.5, 0.5, 0.5, -0.5])
    first = new["moe_layers"]["moe"]["expert_bias"][0] if scan else new["layer_1"]["moe"]["expert_bias"]
    np.testing.assert_array_equal(first, [-0.5, 0.5, 0.5, 0.5])


def test_a_run_records_mtp_loss_and_the_mtp_layer_loads(tmp_path):
    cfg = config.build("deepseek-v3-tiny", ["train.steps=2", "parallel.devices=1"])
    assert run(cfg, tmp_path, log=lambda s: None) == EXIT_OK
    rec = records(tmp_path)[-1]
    assert np.isfinite(rec["mtp_loss"]) and rec["mtp_loss"] > 0
    assert np.asarray(rec["tokens_per_expert"]).shape == (3, 8)


def test_without_mtp_the_record_says_none(tmp_path):
    cfg = config.build("tiny", ["train.steps=1", "parallel.devices=1"])
    run(cfg, tmp_path, log=lambda s: None)
    rec = records(tmp_path)[-1]
    assert rec["mtp_loss"] is None
