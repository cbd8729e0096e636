"""Flat all-to-all over the whole EP group: each assignment goes straight to its expert.

Shape letters (``moe_train.base.notation``): T this shard's tokens, H hidden, K top-k, C slots
per (source, destination) pair, R = ep * C buffer rows (ep: the EP size), M = T*K assignments.

Each row carries its combine weight to the expert, which scales its SwiGLU activation by it
(``moe_train.moe.layer.expert_steps``), so the combine is linear: the backward needs none of
its results, and under ``train.remat`` the recomputed forward stops at the experts (five
exchanges of rows per MoE layer, not six; weighing at the source needed the returned rows
again for the weights' gradient).

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
from moe_train.moe.dispatch.contract import Arrived, ExchangeStats, OnContext, static
from moe_train.moe.dispatch.fp8 import send_rows
from moe_train.moe.permute import sum_rows
from moe_train.parallel import jobplan
from moe_train.parallel.sharding import EP_AXES, EXPERT_X


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class A2ASent:
    """What ``A2A.combine`` needs."""

    slot_M: jax.Array  # send-buffer slot of each assignment (R: not sent)
    stats: ExchangeStats  # measured by the dispatch
    top_k: int = static()  # K: assignments per token
    dtype: Any = static()  # the tokens' dtype


class A2A(OnContext):
    """Send every assignment's row, with its combine weight, to its expert's shard; the rows
    come back weighted and each token's K rows are summed here, in fp32."""

    sent_type: ClassVar[type[A2ASent]] = A2ASent

    def dispatch(self, x_TH, weights_TK, experts_TK) -> tuple[Arrived, A2ASent]:
        T, K = experts_TK.shape
        per_shard, ep = self.ctx.local_experts, self.ctx.plan.ep
        stage = jobplan.a2a_stage(T, K, per_shard, ep, self.ctx.plan.capacity_factor)
        with jax.named_scope("pack"):
            packed = pack(
                x_TH, experts_TK // per_shard, experts_TK % per_shard, ep, stage.slots, per_shard, weights_TK
            )
        recv_counts = all_to_all(packed.counts, EP_AXES)  # the small exchange first
        rows = send_rows(lambda r: all_to_all(r, EP_AXES), packed.x_RH, self.ctx.plan.dispatch_dtype)
        ids_A1, w_A1 = (all_to_all(v, EP_AXES)[:, None] for v in (packed.ids_R, packed.w_R))
        arrived = Arrived(rows, ids_A1, w_A1, x_TH.dtype)
        domain = jax.lax.axis_index(EXPERT_X)
        stats = pair_stats(recv_counts, stage.slots, stage.balanced)
        stats["slow_rows"] = jnp.sum(experts_TK // per_shard // self.ctx.domain_size != domain).astype(
            jnp.float32
        )
        return arrived, A2ASent(packed.slot_M, stats, K, x_TH.dtype)

    def combine(self, y_RH, sent: A2ASent) -> tuple[jax.Array, ExchangeStats]:
        y_MH = unpack(all_to_all(y_RH, EP_AXES), sent.slot_M)
        return sum_rows(y_MH, sent.top_k, sent.dtype), sent.stats
