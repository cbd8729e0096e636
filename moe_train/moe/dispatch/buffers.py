"""Send and receive buffers of the bucketed exchanges (``a2a``, ``hierarchical``).

Letter key: X rows to send (this shard's tokens, or the rows an earlier stage delivered), H
hidden, J expert ids per row, N = X*J assignments, C slots per (source, destination) pair, R
rows of a buffer (destinations x C).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from moe_train.moe.permute import readers_of, take_rows


def all_to_all(x, axis):
    """Tiled all-to-all along ``axis`` over the leading dimension."""
    return jax.lax.all_to_all(x, axis_name=axis, split_axis=0, concat_axis=0, tiled=True)


class Packed(NamedTuple):
    """A send buffer of ``n_dest * C`` rows and where each assignment went."""

    x_RH: jax.Array  # rows, destination-major, C slots each
    ids_R: jax.Array  # local expert of each row at its destination (L: empty slot)
    slot_N: jax.Array  # slot of assignment n (R: not sent)
    counts: jax.Array  # [n_dest] assignments this shard has for each destination


def pack(x_XH, dest_XJ, local_XJ, n_dest: int, C: int, L: int) -> Packed:
    """Slot of every assignment (x, j): destination ``dest[x, j]``, then the order of its local
    expert, then of x (``dest == n_dest``: stays out of this exchange); rows past C slots of
    a destination are not sent (the exchange then reports ``overflow``)."""
    X, J = dest_XJ.shape
    R, N = n_dest * C, X * J
    dest_N = dest_XJ.reshape(-1)
    local_N = jnp.where(dest_N < n_dest, local_XJ.reshape(-1), 0)
    order_N = jnp.argsort(dest_N * L + local_N, stable=True)
    counts = jnp.bincount(dest_N, length=n_dest + 1).astype(jnp.int32)
    start = jnp.cumsum(counts) - counts
    pos_N = (
        jnp.zeros((N,), jnp.int32).at[order_N].set(jnp.arange(N, dtype=jnp.int32) - start[dest_N[order_N]])
    )
    slot_N = jnp.where((dest_N < n_dest) & (pos_N < C), dest_N * C + pos_N, R)
    x_RH = gather_rows(x_XH, slot_N, J, R)
    ids_R = jnp.full((R,), L, jnp.int32).at[slot_N].set(local_N, mode="drop")
    return Packed(x_RH, ids_R, slot_N, counts[:n_dest])


def gather_rows(x_XH, slot_N, per_row: int, R: int):
    """[R, H] send buffer: slot r holds ``x_XH[n // per_row]`` for the assignment n whose
    ``slot_N[n]`` is r, zero where none is (``take_rows``). A gather from the rows, not a
    scatter into a zero-filled [R, H] buffer: XLA:GPU hoisted those zero buffers out of the
    layer and micro-batch loops and held dozens at once (deepseek-v3 at 4 layers, EP 64: 40
    buffers of 448 MiB at its peak; ``make compile``)."""
    N = slot_N.shape[0]
    src_R = readers_of(slot_N, R)[:, 0]
    return take_rows(x_XH, src_R // per_row, src_R < N, slot_N.reshape(-1, per_row))


def unpack(y_RH, slot_N):
    """Row of every assignment from the returned buffer (zero where it was not sent); the
    backward gathers too (``take_rows``)."""
    R = y_RH.shape[0]
    return take_rows(y_RH, slot_N, slot_N < R, readers_of(slot_N, R))


def pair_stats(recv_counts, C: int, balanced: float) -> dict:
    """Exchange stats of one bucketed exchange from the counts each source sent here."""
    return {
        "overflow": jnp.any(recv_counts > C),
        "recv_rows": jnp.sum(jnp.minimum(recv_counts, C)).astype(jnp.float32),
        "recv_slots": jnp.float32(recv_counts.shape[0] * C),
        "max_pair_load": jnp.max(recv_counts).astype(jnp.float32) / balanced,
    }
