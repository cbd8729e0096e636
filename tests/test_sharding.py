"""The logical-axis rules: expert weights over EP x data, other weights over every device, by
whatever mesh axes divide their widths."""

import flax.linen as nn
import jax
import numpy as np
import pytest
from helpers import records
from jax.sharding import PartitionSpec as P

from moe_train import config
from moe_train.parallel import sharding


def spec(axes, rules) -> P:
    got = nn.logical_to_mesh_axes(axes, rules)
    assert got is not None  # (None: no axes given)
    return got


def sizes(data, expert_x, expert):
    return {sharding.DATA: data, sharding.EXPERT_X: expert_x, sharding.EXPERT: expert}


def test_non_expert_weights_are_sharded_over_every_device():
    assert spec(("embed", "mlp"), sharding.LOGICAL_RULES) == P(sharding.TOKEN_AXES, None)


def test_expert_weights_take_ep_axes_then_data_for_their_width():
    got = spec(("expert", "embed", "mlp"), sharding.LOGICAL_RULES)
    assert got == P(sharding.EP_AXES, "data", None)


def test_where_the_devices_divide_every_width_the_rules_are_the_table():
    cfg, mesh = config.build("mixtral-8x7b"), sizes(16, 8, 8)
    rules = sharding.logical_rules(cfg, mesh)
    for _, axes in sharding.weights(cfg.model, cfg.moe):
        names = tuple(a for a, _ in axes)
        assert spec(names, rules) == spec(names, sharding.LOGICAL_RULES), names


def test_a_width_the_devices_do_not_divide_leaves_its_other_axes_the_rest():
    """DeepSeek-V3 on 2048 GPUs, EP 64: 7168 takes 256 of them, the other axis the rest."""
    cfg, mesh = config.build("deepseek-v3"), sizes(32, 8, 8)
    rules = sharding.logical_rules(cfg, mesh)
    for axes in [
        ("embed", "mlp"),
        ("vocab", "embed"),
        ("heads", "head_dim", "embed"),
        ("embed", "expert_gate"),
        ("mtp_concat", "embed"),
    ]:
        assert sharding.split_ways(axes, rules, mesh) == 2048, axes


def test_mla_up_projections_split_over_every_device_where_the_latent_cannot():
    """128 h100 nodes, EP 64: q_lora 1536 and kv_lora 512 do not divide over 1024 GPUs."""
    cfg, mesh = config.build("deepseek-v3"), sizes(16, 8, 8)
    rules = sharding.logical_rules(cfg, mesh)
    assert sharding.split_ways(("q_lora", "heads", "head_dim"), rules, mesh) == 1024
    assert sharding.split_ways(("kv_lora", "heads", "head_dim"), rules, mesh) == 1024


def test_kv_a_output_splits_by_its_own_width():
    """kv_a's output is the 512-wide latent and the 64-wide RoPE key: 576 splits 64 ways."""
    cfg, mesh = config.build("deepseek-v3"), sizes(2, 8, 8)
    got = spec(("embed", "kv_lora_rope"), sharding.logical_rules(cfg, mesh))
    assert 576 % sharding.mesh_size(got[1], mesh) == 0


def test_a_weight_in_use_is_whole():
    """Every axis the rules may split has an in-use name (``layers.gathered``) that they don't
    (the router is gathered by the MoE layer's shard_map)."""
    from moe_train.model.layers import IN_USE

    rules = sharding.logical_rules(config.build("deepseek-v3"), sizes(32, 8, 8))
    split = set(sharding.SPLIT_ORDER) - {"expert_gate"}
    assert split <= set(IN_USE)
    assert all(spec((IN_USE[a],), rules) == P(None) for a in split)


def test_param_shardings_split_a_weight_eight_ways():
    mesh = sharding.make_mesh(jax.devices()[:8], (2, 2, 2))
    boxed = {"w": nn.LogicallyPartitioned(jax.ShapeDtypeStruct((64, 16), "float32"), ("embed", "mlp"))}
    sh = sharding.param_shardings(boxed, mesh)["w"]
    assert sh.shard_shape((64, 16)) == (8, 16)


def test_the_layers_axis_of_scanned_weights_is_never_sharded():
    rules, expert = sharding.LOGICAL_RULES, ("layers", "expert", "embed", "mlp")
    assert spec(("layers", "embed", "mlp"), rules) == P(None, sharding.TOKEN_AXES, None)
    assert spec(expert, rules) == P(None, sharding.EP_AXES, "data", None)
    narrow = sharding.logical_rules(config.build("deepseek-v3"), sizes(32, 8, 8))
    assert spec(("layers", "embed", "mlp"), narrow)[0] is None


def test_scanned_weights_shard_every_other_dim_like_their_looped_layers():
    from moe_train.model.settings import model_settings
    from moe_train.model.transformer import Transformer, to_looped

    mesh = sharding.make_mesh(jax.devices()[:8], (2, 2, 2))
    specs = {}
    for scan in ("true", "false"):
        cfg = config.build(
            "tiny", [f"model.scan_layers={scan}", "model.num_layers=3", "model.first_dense_layers=1"]
        )
        model = Transformer(model_settings(cfg))
        boxed = jax.eval_shape(
            lambda k, model=model: model.init(k, jax.numpy.zeros((1, 8), int))["params"], jax.random.key(0)
        )
        specs[scan] = jax.tree.map(lambda sh: sh.spec, sharding.param_shardings(boxed, mesh))
    stacked = [s for g in ("dense_layers", "moe_layers") for s in jax.tree.leaves(specs["true"][g])]
    assert stacked and all(s[0] is None for s in stacked)
    assert to_looped(specs["true"], cfg.model, take=lambda s, _: P(*s[1:])) == specs["false"]


@pytest.mark.slow
def test_weights_split_by_heads_vocab_and_mlp_train_like_one_device(tmp_path):
    """Width 36 and latents 12 on 8 devices (FSDP 4 x EP 2): the width and the latents take
    4 devices, the heads, vocab, mlp and MTP rows the other 2 (``logical_rules``); gathered
    for use, they compute what one device does."""

    import numpy as np

    from moe_train.train.loop import EXIT_OK, run

    base = [
        "train.steps=2",
        "train.log_every=100",
        "train.batch_size=8",
        "train.seq_len=16",
        "model.hidden=36",
        "model.q_lora_rank=12",
        "model.kv_lora_rank=12",
    ]
    got = {}
    for devices, ep in ((1, 1), (8, 2)):
        cfg = config.build("deepseek-v3-tiny", [*base, f"parallel.devices={devices}", f"parallel.ep={ep}"])
        assert run(cfg, tmp_path / str(devices), log=lambda s: None) == EXIT_OK
        got[devices] = [[r["loss"], r["mtp_loss"], r["grad_norm"]] for r in records(tmp_path / str(devices))]
    rules = sharding.logical_rules(cfg, sizes(4, 1, 2))
    assert spec(("q_lora", "heads", "head_dim"), rules)[1] == sharding.EXPERT
    np.testing.assert_allclose(got[8], got[1], rtol=2e-5)


@pytest.mark.parametrize(
    "ids,platform,run",
    [
        (np.arange(8).reshape(2, 4), "gpu", 4),
        (np.arange(8).reshape(2, 4), "cuda", 4),
        (np.arange(8).reshape(2, 4), "cpu", 0),  # an XLA:GPU option
        (np.arange(8).reshape(1, 8), "gpu", 0),  # one domain: nothing crosses
        (np.arange(8).reshape(8, 1), "gpu", 0),  # one GPU a domain: nothing to split
        (np.array([[0, 1, 2, 4], [3, 5, 6, 7]]), "gpu", 0),  # not runs of ids
        (np.array([[2, 3], [0, 1]]), "gpu", 2),  # aligned runs in any order
        (np.array([[1, 2], [3, 0]]), "gpu", 0),  # runs, but not aligned to their length
    ],
)
def test_all_reduces_split_by_domain_only_over_aligned_runs_of_gpus(ids, platform, run):
    assert sharding.blueconnect_run(ids, platform) == run


def test_a_cpu_mesh_takes_no_collective_options():
    mesh = sharding.make_mesh(jax.devices()[:8], (2, 1, 4))
    assert sharding.all_reduce_options(mesh) == {}
