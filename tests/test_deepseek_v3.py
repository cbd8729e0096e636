"""The DeepSeek-V3 architecture (MLA + MTP, ``deepseek-v3-tiny``) through the train step: the
same losses under FSDP and expert parallelism as on one device, under every remat policy,
and in the looped layout; the real preset's shape and plan."""

import numpy as np
import pytest
from helpers import records

from moe_train import config
from moe_train.model import remat
from moe_train.train.loop import EXIT_OK, run

STEPS = 2


def losses(tmp_path, name, *extra):
    cfg = config.build(
        "deepseek-v3-tiny",
        [f"train.steps={STEPS}", "train.log_every=100", "train.batch_size=8", "train.seq_len=32", *extra],
    )
    assert run(cfg, tmp_path / name, log=lambda s: None) == EXIT_OK
    recs = records(tmp_path / name)
    return np.asarray([[r["loss"], r["mtp_loss"], r["grad_norm"]] for r in recs])


@pytest.fixture(scope="module")
def one_device(tmp_path_factory):
    return losses(tmp_path_factory.mktemp("one"), "one", "parallel.devices=1")


@pytest.mark.slow
@pytest.mark.parametrize(
    "extra",
    [
        ["parallel.devices=4", "parallel.ep=1"],  # FSDP 4
        ["parallel.devices=4", "parallel.ep=4"],  # EP 4: two experts per device
        ["parallel.devices=4", "parallel.ep=2"],  # EP 2 x FSDP 2
    ],
    ids=["fsdp4", "ep4", "ep2-fsdp2"],
)
def test_parallel_runs_match_one_device(tmp_path, one_device, extra):
    np.testing.assert_allclose(losses(tmp_path, "par", *extra), one_device, rtol=2e-5)


@pytest.mark.slow
@pytest.mark.parametrize("policy", [p for p in remat.POLICIES if p != "none"])
def test_every_remat_policy_takes_the_same_steps(tmp_path, one_device, policy):
    got = losses(tmp_path, policy, "parallel.devices=1", f"train.remat={policy}")
    np.testing.assert_allclose(got, one_device, rtol=2e-5)


def test_the_looped_layout_gives_the_same_losses():
    import dataclasses

    import flax.linen as nn
    import jax
    import jax.numpy as jnp

    from moe_train.model.settings import model_settings
    from moe_train.model.transformer import Transformer, to_looped
    from moe_train.train import step as train

    cfg = config.build("deepseek-v3-tiny", ["train.seq_len=16"])
    looped = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, scan_layers=False))
    variables = Transformer(model_settings(cfg)).init(jax.random.key(0), jnp.zeros((1, 16), jnp.int32))
    params, moe_state = nn.unbox(variables["params"]), variables["moe_state"]
    batch = jnp.asarray(np.random.default_rng(0).integers(0, 256, (4, 17)), jnp.int32)
    got = train._loss_fn(
        to_looped(params, cfg.model),
        {},
        to_looped(moe_state, cfg.model),
        batch,
        Transformer(model_settings(looped)),
        looped,
        mtp_weight=0.3,
    )
    want = train._loss_fn(params, {}, moe_state, batch, Transformer(model_settings(cfg)), cfg, mtp_weight=0.3)
    for key in ("ce", "mtp", "seq_aux"):
        np.testing.assert_allclose(got[1][key], want[1][key], rtol=1e-6)
    np.testing.assert_allclose(got[0], want[0], rtol=1e-6)


def test_the_real_preset_is_the_published_architecture():
    m = config.build("deepseek-v3").model
    assert (m.attention_kind, m.q_lora_rank, m.kv_lora_rank) == ("mla", 1536, 512)
    assert (m.qk_nope_head_dim, m.qk_rope_head_dim, m.v_head_dim) == (128, 64, 128)
    assert (m.num_layers, m.first_dense_layers, m.mtp_depth) == (61, 3, 1)
    assert config.build("deepseek-v3").rope.layout == "interleaved"
    assert config.attention_dims(m) == (192, 128, 128)


def test_gqa_fields_are_ignored_by_mla_and_their_rules_too():
    # num_kv_heads need not divide num_heads under MLA: each head has its own keys
    cfg = config.build("deepseek-v3-tiny", ["model.num_kv_heads=3"])
    assert config.attention_dims(cfg.model)[2] == cfg.model.num_heads


@pytest.mark.slow
def test_resume_is_bitwise_with_mla_and_mtp(tmp_path):
    def cfg(steps):
        return config.build(
            "deepseek-v3-tiny",
            [
                f"train.steps={steps}",
                "train.checkpoint_every=2",
                "train.batch_size=4",
                "optim.decay_steps=10",  # the schedule must not depend on train.steps
                "train.seq_len=16",
                "parallel.devices=1",
                "train.log_every=100",
            ],
        )

    assert run(cfg(4), tmp_path / "straight", log=lambda s: None) == EXIT_OK
    assert run(cfg(2), tmp_path / "resumed", log=lambda s: None) == EXIT_OK
    assert run(cfg(4), tmp_path / "resumed", log=lambda s: None) == EXIT_OK
    keys = ("loss", "mtp_loss", "grad_norm", "tokens_per_expert")
    got, want = records(tmp_path / "resumed"), records(tmp_path / "straight")
    assert [r["step"] for r in got] == [1, 2, 3, 4]
    assert [[r[k] for k in keys] for r in got] == [[r[k] for k in keys] for r in want]
