"""EP size 1: every expert is on this shard, so nothing is exchanged.

Letter key: T tokens, H hidden, K top-k. The pipeline of ``moe_train.moe.layer`` with this
dispatcher is exactly the single-device layer ``dropless_moe``.
"""

from __future__ import annotations

from moe_train.moe.dispatch import Arrived, Context
from moe_train.moe.stats import exchange_stats


class Local:
    """Identity exchange: the tokens, their experts and their weights stay where they are."""

    def __init__(self, ctx: Context | None = None):
        self.ctx = ctx

    def dispatch(self, x_TH, weights_TK, experts_TK):
        return Arrived(x_TH, experts_TK, weights_TK, x_TH.dtype, spare=False), experts_TK.size

    def combine(self, y_TH, assignments: int):
        return y_TH, exchange_stats(assignments)
