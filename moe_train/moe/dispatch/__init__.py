"""Token dispatchers for expert parallelism; each runs inside ``shard_map`` on one shard.

Shape letters (``moe_train.base.notation``): T this shard's tokens, H hidden, K top-k (the
expert ids a row carries), E this shard's experts, O fast-link domains in the EP group (mesh axis
``expert_x``; each of ``domain_size`` shards, axis ``expert``), C slots per (source, destination)
pair, A rows arriving at a shard, X rows to send, R rows of an exchange buffer.

A dispatcher is the exchange around the single-device steps (``moe_train.moe.layer``); every
one implements the ``Dispatcher`` protocol (``contract``): ``dispatch`` sends each token to
the shards holding its experts and returns what arrived here (``Arrived``: rows, their local
expert ids, and combine weights when the weighted sum runs here) with the dispatcher's own
metadata (``sent_type``), ``combine`` takes the experts' outputs and that metadata, sends the
outputs back and returns ``(y_TH, exchange stats)``. One file per dispatcher, each with its
metadata type: ``local`` (EP size 1: no exchange; ``LocalSent``), ``allgather``
(``AllGatherSent``), ``a2a`` (flat all-to-all in capacity-bucketed slots; ``A2ASent``),
``hierarchical`` (two stages, each token crosses the slow links once per remote domain;
``HierarchicalSent``). ``buffers``: the bucketed exchanges' send and receive buffers.
``fp8``: ``send_rows``, the row exchange each of them uses for the dispatched activations,
optionally as e4m3 with per-row scales (``moe.dispatch_dtype``). Exchange stats
(``moe_train.moe.stats``): ``overflow`` (a pair needed more than C slots: the step must be
rerun on a larger bucket), ``recv_rows``/``recv_slots``, ``max_pair_load`` and ``slow_rows``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from moe_train.moe.dispatch.a2a import A2A, A2ASent
from moe_train.moe.dispatch.allgather import AllGather, AllGatherSent
from moe_train.moe.dispatch.buffers import Packed, all_to_all, gather_rows, pack, pair_stats, unpack
from moe_train.moe.dispatch.contract import Arrived, Context, Dispatcher, ExchangeStats
from moe_train.moe.dispatch.hierarchical import Hierarchical, HierarchicalSent
from moe_train.moe.dispatch.local import Local, LocalSent

# the dispatcher ``parallel.jobplan.dispatcher`` picks for ``moe.dispatcher`` -> its class
BY_NAME: dict[str, Callable[[Context], Dispatcher[Any]]] = {
    "local": Local,
    "allgather": AllGather,
    "a2a": A2A,
    "hierarchical": Hierarchical,
}


def dispatcher(ctx: Context) -> Dispatcher[Any]:
    """The dispatcher object for ``ctx.plan.dispatcher``."""
    return BY_NAME[ctx.plan.dispatcher](ctx)


__all__ = [
    "A2A",
    "A2ASent",
    "AllGather",
    "AllGatherSent",
    "Arrived",
    "BY_NAME",
    "Context",
    "Dispatcher",
    "ExchangeStats",
    "Hierarchical",
    "HierarchicalSent",
    "Local",
    "LocalSent",
    "Packed",
    "all_to_all",
    "dispatcher",
    "gather_rows",
    "pack",
    "pair_stats",
    "unpack",
]
