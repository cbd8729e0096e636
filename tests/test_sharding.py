"""The logical-axis table: expert weights over EP x data, other weights over every device."""

import flax.linen as nn
import jax
from jax.sharding import PartitionSpec as P

from moe_train.parallel import sharding


def spec(axes, rules):
    return nn.logical_to_mesh_axes(axes, rules)


def test_non_expert_weights_are_sharded_over_every_device():
    assert spec(("embed", "mlp"), sharding.LOGICAL_RULES) == P(sharding.TOKEN_AXES, None)


def test_expert_weights_take_ep_axes_then_data_for_their_width():
    got = spec(("expert", "embed", "mlp"), sharding.LOGICAL_RULES)
    assert got == P(sharding.EP_AXES, "data", None)


def test_a_width_the_devices_do_not_divide_falls_back_to_data():
    rules = sharding.logical_rules(7168, 72)
    assert spec(("embed", "mlp"), rules) == P("data", None)


def test_a_width_the_devices_divide_uses_every_device():
    assert sharding.logical_rules(7168, 128) is sharding.LOGICAL_RULES


def test_param_shardings_split_a_weight_eight_ways():
    mesh = sharding.make_mesh(jax.devices()[:8], (2, 2, 2))
    boxed = {"w": nn.LogicallyPartitioned(jax.ShapeDtypeStruct((64, 16), "float32"),
                                          ("embed", "mlp"))}
    sh = sharding.param_shardings(boxed, mesh)["w"]
    assert sh.shard_shape((64, 16)) == (8, 16)


def test_the_layers_axis_of_scanned_weights_is_never_sharded():
    rules, expert = sharding.LOGICAL_RULES, ("layers", "expert", "embed", "mlp")
    assert spec(("layers", "embed", "mlp"), rules) == P(None, sharding.TOKEN_AXES, None)
    assert spec(expert, rules) == P(None, sharding.EP_AXES, "data", None)
    narrow = sharding.logical_rules(7168, 72)
    assert spec(("layers", "embed", "mlp"), narrow) == P(None, "data", None)


def test_scanned_weights_shard_every_other_dim_like_their_looped_layers():
    from moe_train import config
    from moe_train.model.transformer import Transformer, to_looped

    mesh = sharding.make_mesh(jax.devices()[:8], (2, 2, 2))
    specs = {}
    for scan in ("true", "false"):
        cfg = config.build("tiny", [f"model.scan_layers={scan}", "model.num_layers=3",
                                    "model.first_dense_layers=1"])
        boxed = jax.eval_shape(lambda k: Transformer(cfg).init(k, jax.numpy.zeros((1, 8), int))
                               ["params"], jax.random.key(0))
        specs[scan] = jax.tree.map(lambda sh: sh.spec, sharding.param_shardings(boxed, mesh))
    stacked = [s for g in ("dense_layers", "moe_layers") for s in jax.tree.leaves(specs["true"][g])]
    assert stacked and all(s[0] is None for s in stacked)
    assert to_looped(specs["true"], cfg.model, take=lambda s, _: P(*s[1:])) == specs["false"]
