"""All-gather dispatch: every shard sees the EP group's tokens and computes its own experts.

Shape letters (``moe_train.base.notation``): T this shard's tokens, K top-k, A the EP group's
tokens (the rows arriving here). The simplest exchange and the baseline the bucketed ones are
measured against: each shard receives every token of the group, so the traffic is the EP size
times the tokens whatever the routing.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import jax
import jax.numpy as jnp

from moe_train.moe.dispatch.contract import Arrived, ExchangeStats, OnContext, static
from moe_train.moe.dispatch.fp8 import send_rows
from moe_train.moe.stats import exchange_stats
from moe_train.parallel.sharding import EP_AXES


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class AllGatherSent:
    """What ``AllGather.combine`` needs."""

    mine: jax.Array  # int32: assignments of the gathered tokens to this shard's experts
    tokens: int = static()  # T
    dtype: Any = static()  # the tokens' dtype
    gathered: int = static()  # assignments of the gathered tokens, A*K


class AllGather(OnContext):
    """Gather the group's tokens; reduce-scatter the partial (weighted) outputs back."""

    sent_type: ClassVar[type[AllGatherSent]] = AllGatherSent

    def dispatch(self, x_TH, weights_TK, experts_TK) -> tuple[Arrived, AllGatherSent]:
        per_shard = self.ctx.local_experts
        rank = jax.lax.axis_index(EP_AXES)
        x_AH = send_rows(
            lambda r: jax.lax.all_gather(r, EP_AXES, tiled=True), x_TH, self.ctx.plan.dispatch_dtype
        )
        e_AK = jax.lax.all_gather(experts_TK, EP_AXES, tiled=True)
        w_AK = jax.lax.all_gather(weights_TK, EP_AXES, tiled=True)
        mine_AK = e_AK // per_shard == rank
        arrived = Arrived(
            x_AH, jnp.where(mine_AK, e_AK % per_shard, per_shard), jnp.where(mine_AK, w_AK, 0.0), jnp.float32
        )
        return arrived, AllGatherSent(jnp.sum(mine_AK), x_TH.shape[0], x_TH.dtype, e_AK.size)

    def combine(self, part_AH, sent: AllGatherSent) -> tuple[jax.Array, ExchangeStats]:
        y_TH = jax.lax.psum_scatter(part_AH, EP_AXES, scatter_dimension=0, tiled=True)
        remote = sent.tokens * (self.ctx.domains - 1) * self.ctx.domain_size  # tokens from other domains
        return y_TH.astype(sent.dtype), exchange_stats(
            sent.gathered, recv_rows=sent.mine.astype(jnp.float32), slow_rows=jnp.float32(remote)
        )
