"""Two-stage dispatch for EP groups that span several fast-link domains.

Shape letters (``moe_train.base.notation``): T this shard's tokens, H hidden, K top-k, O
fast-link domains in the EP group (mesh axis ``expert_x``, the slow links), C1/C2 slots per pair
of stage 1/2, R1 = O*C1 and R2 = per_domain*C2 buffer rows (per_domain: shards per domain, mesh
axis ``expert``).

Stage 1 sends each token once to every domain holding one of its experts, with its expert
ids and weights there; stage 2 fans the rows out inside the domain as ``a2a`` does, each with
its weight, which the expert applies (the combine is linear, so the recomputed forward of
``train.remat`` stops at the experts). Combine runs in reverse: stage 2's weighted rows are
summed per stage-1 row in fp32, and those partial sums cross the slow links once per (token,
domain). Slot sizes:
``moe_train.parallel.jobplan.hierarchical_stages``.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import jax
import jax.numpy as jnp

from moe_train.moe.dispatch.buffers import all_to_all, gather_rows, pack, pair_stats, unpack
from moe_train.moe.dispatch.contract import Arrived, ExchangeStats, OnContext, static
from moe_train.moe.dispatch.fp8 import send_rows
from moe_train.moe.permute import sum_rows
from moe_train.parallel import jobplan
from moe_train.parallel.sharding import EXPERT, EXPERT_X

SLOW, FAST = EXPERT_X, EXPERT


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class HierarchicalSent:
    """What ``Hierarchical.combine`` needs: where each stage put its rows."""

    slot2_M: jax.Array  # stage-2 send slot of each (stage-1 row, k) assignment (R2: not sent)
    slot1: jax.Array  # [T*O]: stage-1 send slot of each (token, domain) (R1: not sent)
    ok_TO: jax.Array  # bool: token t was sent to domain o
    stats: ExchangeStats  # measured by the dispatch, both stages
    top_k: int = static()  # K: assignments per stage-1 row
    dtype: Any = static()  # the tokens' dtype


class Hierarchical(OnContext):
    """Token rows over the slow links once per remote domain, then assignments inside it."""

    sent_type: ClassVar[type[HierarchicalSent]] = HierarchicalSent

    def _stage_one(self, x_TH, weights_TK, experts_TK, C1: int):
        """Send buffers of stage 1: the token, its experts in that domain (-1 elsewhere) and
        their weights, in C1 slots per domain."""
        T, K = experts_TK.shape
        per_shard, O, per_domain = self.ctx.local_experts, self.ctx.domains, self.ctx.domain_size
        dom_TK = experts_TK // (per_shard * per_domain)
        need_TO = jnp.any(dom_TK[:, :, None] == jnp.arange(O), axis=1)
        pos_TO = jnp.cumsum(need_TO, axis=0, dtype=jnp.int32) - 1
        ok_TO = need_TO & (pos_TO < C1)
        slot = jnp.where(ok_TO, jnp.arange(O) * C1 + pos_TO, O * C1).reshape(-1)
        in_dom_TOK = dom_TK[:, None, :] == jnp.arange(O)[None, :, None]
        send_x = gather_rows(x_TH, slot, O, O * C1)
        send_e = (
            jnp.full((O * C1, K), -1, jnp.int32)
            .at[slot]
            .set(jnp.where(in_dom_TOK, experts_TK[:, None, :], -1).reshape(T * O, K), mode="drop")
        )
        send_w = (
            jnp.zeros((O * C1, K), jnp.float32)
            .at[slot]
            .set(jnp.where(in_dom_TOK, weights_TK[:, None, :], 0.0).reshape(T * O, K), mode="drop")
        )
        return send_x, send_e, send_w, slot, ok_TO, need_TO

    def dispatch(self, x_TH, weights_TK, experts_TK) -> tuple[Arrived, HierarchicalSent]:
        T, K = experts_TK.shape
        per_shard, O, per_domain = self.ctx.local_experts, self.ctx.domains, self.ctx.domain_size
        one, two = jobplan.hierarchical_stages(T, K, per_shard, O, per_domain, self.ctx.plan.capacity_factor)
        with jax.named_scope("pack"):
            send_x, send_e, send_w, slot1, ok_TO, need_TO = self._stage_one(
                x_TH, weights_TK, experts_TK, one.slots
            )
        recv_counts1 = all_to_all(need_TO.sum(axis=0).astype(jnp.int32), SLOW)
        r_e = all_to_all(send_e, SLOW)
        fp8 = self.ctx.plan.dispatch_dtype
        r_x = send_rows(lambda r: all_to_all(r, SLOW), send_x, fp8)
        r_w = all_to_all(send_w, SLOW)
        dest2 = jnp.where(r_e >= 0, (r_e // per_shard) % per_domain, per_domain)
        with jax.named_scope("pack"):
            packed2 = pack(r_x, dest2, r_e % per_shard, per_domain, two.slots, per_shard, r_w)
        recv_counts2 = all_to_all(packed2.counts, FAST)
        rows = send_rows(lambda r: all_to_all(r, FAST), packed2.x_RH, fp8)
        ids_A1, w_A1 = (all_to_all(v, FAST)[:, None] for v in (packed2.ids_R, packed2.w_R))
        arrived = Arrived(rows, ids_A1, w_A1, x_TH.dtype)
        stats = pair_stats(recv_counts2, two.slots, two.balanced)
        first = pair_stats(recv_counts1, one.slots, one.balanced)
        domain = jax.lax.axis_index(SLOW)
        stats.update(
            overflow=stats["overflow"] | first["overflow"],
            max_pair_load=jnp.maximum(stats["max_pair_load"], first["max_pair_load"]),
            slow_rows=(need_TO.sum() - need_TO[:, domain].sum()).astype(jnp.float32),
        )
        return arrived, HierarchicalSent(packed2.slot_M, slot1, ok_TO, stats, K, x_TH.dtype)

    def combine(self, y_R2H, sent: HierarchicalSent) -> tuple[jax.Array, ExchangeStats]:
        part_R1H = sum_rows(unpack(all_to_all(y_R2H, FAST), sent.slot2_M), sent.top_k, jnp.float32)
        back_R1H = all_to_all(part_R1H, SLOW)
        T, O = sent.ok_TO.shape
        # slot1 is O*C1 (past the rows) where ok_TO is False: those rows come back zero; a
        # gather both ways (autodiff's scatter-add into an fp32 zero [O*C1, H] buffer let
        # XLA:GPU hoist eight of them, 0.44 GiB each, deepseek-v3's MTP block: make compile)
        y_TOH = unpack(back_R1H, sent.slot1).reshape(T, O, -1)
        return y_TOH.sum(axis=1).astype(sent.dtype), sent.stats
