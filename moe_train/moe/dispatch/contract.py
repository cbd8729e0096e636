"""The dispatcher contract: what the MoE pipeline (``moe_train.moe.layer``) calls on every
token exchange, and the types it passes.

Shape letters (``moe_train.base.notation``): T this shard's tokens, H hidden, K top-k (the
expert ids an arriving row carries: K, or 1 where each row is one assignment), A rows arriving
at a shard.

The pipeline runs, on each shard inside ``shard_map``::

    arrived, sent = dispatcher.dispatch(x_TH, weights_TK, experts_TK)   # named_scope "dispatch"
    y_AH = permute -> grouped_gemm -> unpermute (arrived)               # the expert steps
    y_TH, exchange = dispatcher.combine(y_AH, sent)                     # named_scope "combine"

``Arrived`` is the same type for every dispatcher: the rows the expert steps compute. ``sent``
is the dispatcher's own metadata type (``Dispatcher.sent_type``: ``LocalSent``,
``AllGatherSent``, ``A2ASent``, ``HierarchicalSent``), which only its ``combine`` reads. Both
are frozen dataclasses registered as JAX pytrees: arrays are leaves, Python values (dtypes,
sizes, flags) are static fields, so they can cross ``jax`` transforms unchanged. ``exchange``
is the exchange fields of ``moe_train.moe.stats.MoEStats`` (``stats.EXCHANGE``).
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar, NamedTuple, Protocol, TypeVar, runtime_checkable

import jax

from moe_train.parallel.jobplan import EPPlan

ExchangeStats = dict[str, jax.Array]  # moe_train.moe.stats.EXCHANGE: overflow, recv_rows, ...


def static(**kw) -> Any:
    """A dataclass field that is pytree metadata (part of the tree's structure), not a leaf."""
    return dataclasses.field(metadata={"static": True}, **kw)


class Context(NamedTuple):
    """Static facts a dispatcher needs besides its operands."""

    plan: EPPlan
    local_experts: int  # experts on each shard (E inside shard_map)
    domains: int  # O: fast-link domains in an EP group (mesh axis expert_x)
    domain_size: int  # shards per domain (mesh axis expert)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Arrived:
    """What a dispatch delivered to this shard's experts."""

    x_AH: jax.Array  # rows to compute
    ids_AK: jax.Array  # local expert of each (row, k); local_experts: none here (output unused)
    weights_AK: jax.Array | None  # combine weights summed here; None: each (row, k) returns
    out_dtype: Any = static()  # dtype of the rows (or sums) sent back
    spare: bool = static(default=True)  # some ids are local_experts (rows or slots with no expert here)


class OnContext:
    """Base of the dispatchers that exchange between shards: they are built from the
    ``Context`` (``BY_NAME[name](ctx)``) and keep it as ``ctx``."""

    def __init__(self, ctx: Context):
        self.ctx = ctx


SentT = TypeVar("SentT")


@runtime_checkable
class Dispatcher(Protocol[SentT]):
    """A token exchange between the shards of an EP group (one per ``moe.dispatcher``)."""

    sent_type: ClassVar[type]  # the metadata type ``dispatch`` returns and ``combine`` takes

    def dispatch(
        self, x_TH: jax.Array, weights_TK: jax.Array, experts_TK: jax.Array, /
    ) -> tuple[Arrived, SentT]:
        """Send each token to the shards holding its experts ``experts_TK`` (global ids, with
        combine weights ``weights_TK``): what arrived here and what ``combine`` needs."""
        ...

    def combine(self, y_AH: jax.Array, sent: SentT, /) -> tuple[jax.Array, ExchangeStats]:
        """Send the expert steps' outputs ``y_AH`` (one row per arrived row) back to their
        tokens: (y_TH in the tokens' dtype, the exchange's stats)."""
        ...
