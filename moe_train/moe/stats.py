"""MoE statistics: one typed pytree from the router and the exchange to the metrics record.

Shape letters (``moe_train.base.notation``): E experts, L layers (the MoE layers: the leading
axis of stacked stats).

Every field says how it combines (``KIND``): counts add up, the router's losses are means,
the exchange's worst-case numbers take the maximum. ``across_shards`` reduces what one shard
of ``shard_map`` measured; ``combine`` folds a stacked axis (chunks of one layer, or the
micro-batches of a step); ``metrics`` exports the per-step values under the names of the
metrics record (``moe_train.train.metrics.step_record``).
"""

from __future__ import annotations

import dataclasses

import flax.struct
import jax
import jax.numpy as jnp

SUM, MEAN, MAX = "sum", "mean", "max"


def _stat(kind: str):
    return flax.struct.field(metadata={"kind": kind})


@flax.struct.dataclass
class MoEStats:
    """One MoE layer's statistics over the whole batch (scalars unless noted); each field's
    ``kind`` says how it combines."""

    tokens_per_expert: jax.Array = _stat(SUM)  # [E] int32: assignments routed to each expert
    aux_loss: jax.Array = _stat(MEAN)  # switch-style balance loss E * sum_e f_e P_e (unscaled)
    seq_aux_loss: jax.Array = _stat(MEAN)  # the same per sequence, averaged (DeepSeek-V3)
    z_loss: jax.Array = _stat(MEAN)  # mean squared logsumexp of the router logits
    router_entropy: jax.Array = _stat(MEAN)  # mean entropy of the per-token distribution
    dropped_tokens: jax.Array = _stat(SUM)  # int32 assignments not computed (0: dropless)
    # The exchange's (EXCHANGE): measured per shard, reduced by across_shards.
    overflow: jax.Array = _stat(MAX)  # bool: an exchange needed more than its bucket's slots
    recv_rows: jax.Array = _stat(SUM)  # rows received into exchange buffers
    recv_slots: jax.Array = _stat(SUM)  # rows of those buffers
    max_pair_load: jax.Array = _stat(MAX)  # largest (source, destination) load / balanced load
    slow_rows: jax.Array = _stat(SUM)  # token rows sent across fast-link domains, one way

    def replace(self, **kw) -> MoEStats:
        return dataclasses.replace(self, **kw)


KIND = {f.name: f.metadata["kind"] for f in dataclasses.fields(MoEStats)}
EXCHANGE = ("overflow", "recv_rows", "recv_slots", "max_pair_load", "slow_rows")


def exchange_stats(rows: float, **kw) -> dict:
    """The exchange fields of a dispatch that received ``rows`` rows into as many slots and
    crossed no domain, with ``kw`` in their place."""
    out = {
        "overflow": jnp.zeros((), bool),
        "recv_rows": jnp.float32(rows),
        "recv_slots": jnp.float32(rows),
        "max_pair_load": jnp.float32(0),
        "slow_rows": jnp.float32(0),
    }
    out.update(kw)
    return out


def across_shards(stats: MoEStats, axes) -> MoEStats:
    """Reduce the exchange fields one shard measured over the mesh ``axes`` (the router's
    fields are already over the whole batch: ``router.router_stats``)."""
    kw = {}
    for key in EXCHANGE:
        v = getattr(stats, key)
        if KIND[key] == SUM:
            kw[key] = jax.lax.psum(v, axes)
        else:
            kw[key] = jax.lax.pmax(v.astype(jnp.int32) if v.dtype == bool else v, axes)
            kw[key] = kw[key] > 0 if v.dtype == bool else kw[key]
    return stats.replace(**kw)


def _fold(key: str, v: jax.Array, axis: int = 0) -> jax.Array:
    if KIND[key] == MEAN:
        return v.mean(axis)
    return v.max(axis) if KIND[key] == MAX else v.sum(axis)


def combine(stacked: MoEStats, axis: int = 0) -> MoEStats:
    """Fold the leading (stacked) axis: chunks of one layer or the micro-batches of a step."""
    return MoEStats(**{k: _fold(k, getattr(stacked, k), axis) for k in KIND})


def combine_exchanges(parts: list[dict]) -> dict:
    """The exchange fields of several dispatches (chunks) folded into one."""
    return {k: _fold(k, jnp.stack([p[k] for p in parts])) for k in EXCHANGE}


def losses(stats_L: MoEStats | None) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(aux, seq_aux, z) router losses, averaged over MoE layers (zeros without any)."""
    if stats_L is None:
        zero = jnp.zeros((), jnp.float32)
        return zero, zero, zero
    return stats_L.aux_loss.mean(), stats_L.seq_aux_loss.mean(), stats_L.z_loss.mean()


def metrics(stats_L: MoEStats | None, num_experts: int) -> dict[str, jax.Array]:
    """The step's MoE metrics from the stats of every MoE layer (stacked [L, ...]):
    per-layer loads, the counts summed over layers, the worst-case values over layers."""
    if stats_L is None:
        return {
            "tokens_per_expert": jnp.zeros((0, num_experts), jnp.int32),
            "dropped_tokens": jnp.zeros((), jnp.int32),
            "overflow": jnp.zeros((), bool),
            "max_pair_load": jnp.float32(0),
            "recv_buffer_fill": jnp.float32(jnp.nan),
            "ep_slow_link_rows": jnp.float32(0),
        }
    rows, slots = stats_L.recv_rows.sum(), stats_L.recv_slots.sum()
    return {
        "tokens_per_expert": stats_L.tokens_per_expert,
        "dropped_tokens": stats_L.dropped_tokens.sum().astype(jnp.int32),
        "overflow": jnp.any(stats_L.overflow),
        "max_pair_load": stats_L.max_pair_load.max(),
        "recv_buffer_fill": jnp.where(slots > 0, rows / jnp.maximum(slots, 1), jnp.nan),
        "ep_slow_link_rows": stats_L.slow_rows.sum(),
    }
