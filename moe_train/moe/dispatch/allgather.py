"""All-gather dispatch: every shard sees the EP group's tokens and computes its own experts.

Letter key: T this shard's tokens, K top-k, L local experts, A the EP group's tokens (the rows arriving here).
The simplest exchange and the baseline the bucketed ones are measured against: each shard
receives every token of the group, so the traffic is P times the tokens whatever the routing.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from moe_train.moe.dispatch import Arrived, Context
from moe_train.moe.dispatch.fp8 import send_rows
from moe_train.moe.stats import exchange_stats
from moe_train.parallel.sharding import EP_AXES


class AllGather:
    """Gather the group's tokens; reduce-scatter the partial (weighted) outputs back."""

    def __init__(self, ctx: Context):
        self.ctx = ctx

    def dispatch(self, x_TH, weights_TK, experts_TK):
        L = self.ctx.local_experts
        rank = jax.lax.axis_index(EP_AXES)
        x_AH = send_rows(
            lambda r: jax.lax.all_gather(r, EP_AXES, tiled=True), x_TH, self.ctx.plan.dispatch_dtype
        )
        e_AK = jax.lax.all_gather(experts_TK, EP_AXES, tiled=True)
        w_AK = jax.lax.all_gather(weights_TK, EP_AXES, tiled=True)
        mine_AK = e_AK // L == rank
        arrived = Arrived(x_AH, jnp.where(mine_AK, e_AK % L, L), jnp.where(mine_AK, w_AK, 0.0), jnp.float32)
        return arrived, (x_TH.shape[0], x_TH.dtype, e_AK.size, jnp.sum(mine_AK))

    def combine(self, part_AH, sent):
        T, dtype, gathered, mine = sent
        y_TH = jax.lax.psum_scatter(part_AH, EP_AXES, scatter_dimension=0, tiled=True)
        remote = T * (self.ctx.domains - 1) * self.ctx.domain_size  # tokens from other domains
        return y_TH.astype(dtype), exchange_stats(
            gathered, recv_rows=mine.astype(jnp.float32), slow_rows=jnp.float32(remote)
        )
