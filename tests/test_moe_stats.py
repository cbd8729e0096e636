"""MoEStats: each field combines by its kind, across shards, stacks and layers."""

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from moe_train.moe import stats as moe_stats
from moe_train.moe.stats import KIND, MoEStats
from moe_train.parallel import sharding


def layer(load, aux, overflow, rows, slots, pair, slow, dropped=0) -> MoEStats:
    f = jnp.float32
    return MoEStats(
        tokens_per_expert=jnp.asarray(load, jnp.int32),
        aux_loss=f(aux),
        seq_aux_loss=f(2 * aux),
        z_loss=f(3 * aux),
        router_entropy=f(aux + 1),
        dropped_tokens=jnp.int32(dropped),
        overflow=jnp.bool_(overflow),
        recv_rows=f(rows),
        recv_slots=f(slots),
        max_pair_load=f(pair),
        slow_rows=f(slow),
    )


def stacked(*layers: MoEStats) -> MoEStats:
    return jax.tree.map(lambda *v: jnp.stack(v), *layers)


A = layer([3, 1], 1.0, False, 4, 8, 1.5, 2)
B = layer([0, 4], 3.0, True, 6, 8, 2.5, 1, dropped=2)


def test_every_field_has_a_kind():
    assert set(KIND) == {f for f in MoEStats.__dataclass_fields__}
    assert set(KIND.values()) == {"sum", "mean", "max"}


def test_combine_sums_counts_averages_losses_and_takes_the_worst():
    c = moe_stats.combine(stacked(A, B))
    np.testing.assert_array_equal(c.tokens_per_expert, [3, 5])
    assert float(c.aux_loss) == 2.0 and float(c.recv_rows) == 10 and int(c.dropped_tokens) == 2
    assert bool(c.overflow) and float(c.max_pair_load) == 2.5


def test_metrics_keep_loads_per_layer_and_name_the_record_fields():
    m = moe_stats.metrics(stacked(A, B), num_experts=2)
    np.testing.assert_array_equal(m["tokens_per_expert"], [[3, 1], [0, 4]])
    assert float(m["recv_buffer_fill"]) == 10 / 16 and float(m["ep_slow_link_rows"]) == 3
    assert bool(m["overflow"]) and int(m["dropped_tokens"]) == 2


def test_metrics_without_moe_layers_have_empty_loads_and_no_fill():
    m = moe_stats.metrics(None, num_experts=4)
    assert m["tokens_per_expert"].shape == (0, 4) and np.isnan(float(m["recv_buffer_fill"]))


def test_losses_average_over_layers():
    aux, seq_aux, z = moe_stats.losses(stacked(A, B))
    assert (float(aux), float(seq_aux), float(z)) == (2.0, 4.0, 6.0)


def test_across_shards_sums_and_maxes_the_exchange_fields():
    mesh = sharding.make_mesh(jax.devices()[:4], (4, 1, 1))

    def shard(i_1):
        i = i_1[0].astype(jnp.float32)
        s = layer([1, 1], 1.0, i == 2, i, 8, i, 1)
        return moe_stats.across_shards(s, sharding.TOKEN_AXES)

    with jax.set_mesh(mesh):
        out = jax.jit(
            jax.shard_map(
                shard, in_specs=P(sharding.TOKEN_AXES), out_specs=P(), check_vma=False
            )  # every field
        )(jnp.arange(4))
    assert float(out.recv_rows) == 6 and float(out.recv_slots) == 32 and float(out.slow_rows) == 4
    assert bool(out.overflow) and float(out.max_pair_load) == 3
