"""EP size 1: every expert is on this shard, so nothing is exchanged.

Shape letters (``moe_train.base.notation``): T tokens, H hidden, K top-k. The pipeline of
``moe_train.moe.layer`` with this dispatcher is exactly the single-device layer
(``dropless_moe`` without a plan).
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax

from moe_train.moe.dispatch.contract import Arrived, Context, ExchangeStats, static
from moe_train.moe.stats import exchange_stats


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LocalSent:
    """What ``Local.combine`` needs: how many assignments stayed here."""

    assignments: int = static()  # T*K


class Local:
    """Identity exchange: the tokens, their experts and their weights stay where they are."""

    sent_type: ClassVar[type[LocalSent]] = LocalSent

    def __init__(self, ctx: Context | None = None):
        self.ctx = ctx

    def dispatch(self, x_TH, weights_TK, experts_TK) -> tuple[Arrived, LocalSent]:
        return Arrived(x_TH, experts_TK, weights_TK, x_TH.dtype, spare=False), LocalSent(experts_TK.size)

    def combine(self, y_TH, sent: LocalSent) -> tuple[jax.Array, ExchangeStats]:
        return y_TH, exchange_stats(sent.assignments)
