"""Send and receive buffers of the bucketed exchanges (``a2a``, ``hierarchical``).

Shape letters (``moe_train.base.notation``): X rows to send (this shard's tokens, or the rows
an earlier stage delivered), H hidden, K expert ids per row, M = X*K assignments, C slots per
(source, destination) pair, R rows of a buffer (destinations x C).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from moe_train.moe.permute import count_ids, readers_of, stable_order, take_rows


def all_to_all(x, axis):
    """Tiled all-to-all along ``axis`` over the leading dimension."""
    return jax.lax.all_to_all(x, axis_name=axis, split_axis=0, concat_axis=0, tiled=True)


class Packed(NamedTuple):
    """A send buffer of ``n_dest * C`` rows and where each assignment went."""

    x_RH: jax.Array  # rows, destination-major, C slots each
    ids_R: jax.Array  # local expert of each row at its destination (per_shard: empty slot)
    w_R: jax.Array  # fp32 combine weight of each row (0: empty slot)
    slot_M: jax.Array  # slot of assignment n (R: not sent)
    counts: jax.Array  # [n_dest] assignments this shard has for each destination


def pack(x_XH, dest_XK, local_XK, n_dest: int, C: int, per_shard: int, w_XK) -> Packed:
    """Slot of every assignment (x, k): destination ``dest[x, k]``, then the order of its local
    expert, then of x (``dest == n_dest``: stays out of this exchange); rows past C slots of
    a destination are not sent (the exchange then reports ``overflow``). Each row carries its
    assignment's combine weight ``w[x, k]`` (the expert applies it)."""
    X, K = dest_XK.shape
    R, M = n_dest * C, X * K
    dest_M = dest_XK.reshape(-1)
    local_M = jnp.where(dest_M < n_dest, local_XK.reshape(-1), 0)
    order_M = stable_order(dest_M * per_shard + local_M, (n_dest + 1) * per_shard)
    counts = count_ids(dest_M, n_dest + 1)
    start = jnp.cumsum(counts) - counts
    pos_M = (
        jnp.zeros((M,), jnp.int32).at[order_M].set(jnp.arange(M, dtype=jnp.int32) - start[dest_M[order_M]])
    )
    slot_M = jnp.where((dest_M < n_dest) & (pos_M < C), dest_M * C + pos_M, R)
    x_RH = gather_rows(x_XH, slot_M, K, R)
    ids_R = jnp.full((R,), per_shard, jnp.int32).at[slot_M].set(local_M, mode="drop")
    w_R = jnp.zeros((R,), jnp.float32).at[slot_M].set(w_XK.reshape(-1).astype(jnp.float32), mode="drop")
    return Packed(x_RH, ids_R, w_R, slot_M, counts[:n_dest])


def gather_rows(x_XH, slot_M, per_row: int, R: int):
    """[R, H] send buffer: slot r holds ``x_XH[n // per_row]`` for the assignment n whose
    ``slot_M[n]`` is r, zero where none is (``take_rows``). A gather from the rows, not a
    scatter into a zero-filled [R, H] buffer: XLA:GPU hoisted those zero buffers out of the
    layer and micro-batch loops and held dozens at once (deepseek-v3 at 4 layers, EP 64: 40
    buffers of 448 MiB at its peak; ``make compile``)."""
    M = slot_M.shape[0]
    src_R = readers_of(slot_M, R)[:, 0]
    return take_rows(x_XH, src_R // per_row, src_R < M, slot_M.reshape(-1, per_row))


def unpack(y_RH, slot_M):
    """Row of every assignment from the returned buffer (zero where it was not sent); the
    backward gathers too (``take_rows``)."""
    R = y_RH.shape[0]
    return take_rows(y_RH, slot_M, slot_M < R, readers_of(slot_M, R))


def pair_stats(recv_counts, C: int, balanced: float) -> dict:
    """Exchange stats of one bucketed exchange from the counts each source sent here."""
    return {
        "overflow": jnp.any(recv_counts > C),
        "recv_rows": jnp.sum(jnp.minimum(recv_counts, C)).astype(jnp.float32),
        "recv_slots": jnp.float32(recv_counts.shape[0] * C),
        "max_pair_load": jnp.max(recv_counts).astype(jnp.float32) / balanced,
    }
