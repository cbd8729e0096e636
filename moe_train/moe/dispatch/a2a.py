"""Flat all-to-all over the whole EP group: each assignment goes straight to its expert.

Shape letters (``moe_train.base.notation``): T this shard's tokens, H hidden, K top-k, C slots
per (source, destination) pair, R = ep * C buffer rows (ep: the EP size), M = T*K assignments.

The receive buffer is static: C slots per pair, a capacity bucket times the balanced load
(``moe_train.parallel.jobplan.a2a_stage``). An exchange that does not fit reports ``overflow`` and
the step is rerun on a larger bucket; the worst-case bucket always fits.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import jax
import jax.numpy as jnp

from moe_train.moe.dispatch.buffers import all_to_all, pack, pair_stats, unpack
from moe_train.moe.dispatch.contract import Arrived, Context, ExchangeStats, static
from moe_train.moe.dispatch.fp8 import send_rows
from moe_train.moe.permute import weighted_sum
from moe_train.parallel import jobplan
from moe_train.parallel.sharding import EP_AXES, EXPERT_X


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class A2ASent:
    """What ``A2A.combine`` needs."""

    slot_M: jax.Array  # send-buffer slot of each assignment (R: not sent)
    weights_TK: jax.Array  # combine weights, applied here
    stats: ExchangeStats  # measured by the dispatch
    dtype: Any = static()  # the tokens' dtype


class A2A:
    """Send every assignment's row to its expert's shard; the rows come back unweighted and
    the combine weights are applied here, in fp32."""

    sent_type: ClassVar[type[A2ASent]] = A2ASent

    def __init__(self, ctx: Context):
        self.ctx = ctx

    def dispatch(self, x_TH, weights_TK, experts_TK) -> tuple[Arrived, A2ASent]:
        T, K = experts_TK.shape
        per_shard, ep = self.ctx.local_experts, self.ctx.plan.ep
        stage = jobplan.a2a_stage(T, K, per_shard, ep, self.ctx.plan.capacity_factor)
        with jax.named_scope("pack"):
            packed = pack(x_TH, experts_TK // per_shard, experts_TK % per_shard, ep, stage.slots, per_shard)
        recv_counts = all_to_all(packed.counts, EP_AXES)  # the small exchange first
        rows = send_rows(lambda r: all_to_all(r, EP_AXES), packed.x_RH, self.ctx.plan.dispatch_dtype)
        arrived = Arrived(rows, all_to_all(packed.ids_R, EP_AXES)[:, None], None, x_TH.dtype)
        domain = jax.lax.axis_index(EXPERT_X)
        stats = pair_stats(recv_counts, stage.slots, stage.balanced)
        stats["slow_rows"] = jnp.sum(experts_TK // per_shard // self.ctx.domain_size != domain).astype(
            jnp.float32
        )
        return arrived, A2ASent(packed.slot_M, weights_TK, stats, x_TH.dtype)

    def combine(self, y_RH, sent: A2ASent) -> tuple[jax.Array, ExchangeStats]:
        y_MH = unpack(all_to_all(y_RH, EP_AXES), sent.slot_M)
        return weighted_sum(y_MH, sent.weights_TK, sent.dtype), sent.stats
