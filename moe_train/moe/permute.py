"""Token dispatch (permute) and combine (unpermute) with static shapes.

Shape letters (``moe_train.base.notation``): T tokens, H hidden, E experts, K top-k, M = T*K
assignments (flat index n = t*K + k), m tile rows, P tiles, R dispatched rows (M unpadded, P*m
for the tiled layout).

A `Dispatch` plan maps every dispatched row to its source token and every assignment to
its dispatched row. Rows are sorted by expert (stable, so token order within an expert);
in the tiled layout each expert's rows start on a tile boundary and the gaps are zero rows.
Everything is computed on device: no host sync, and no recompilation when routing changes.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from moe_train.base.arith import cdiv
from moe_train.moe.dma_rows import DmaRows, gather_sum


class Dispatch(NamedTuple):
    """Static-shape routing plan (all int32 except `valid_R`)."""

    token_R: jax.Array  # source token of each dispatched row (0 for padding rows)
    valid_R: jax.Array  # bool, False for padding rows
    row_M: jax.Array  # dispatched row of assignment n = t*K + k
    group_sizes_E: jax.Array  # assignments per expert, sums to M
    tile_expert_P: jax.Array | None  # expert of each tile (tiled layout only)
    slot_R: jax.Array  # assignment n each dispatched row holds (M for padding rows): row_M's inverse


def cdiv_array(a: jax.Array, b: int) -> jax.Array:
    return (a + (b - 1)) // b


def tiled_padding(num_assignments: int, num_experts: int, tile_rows: int) -> tuple[int, int]:
    """(tiles P, padded rows P*m) that the tiled layout executes for M assignments.

    Worst case over all routings. Write g_e = q_e*m + r_e (0 <= r_e < m) and let j be the
    number of experts with r_e > 0. Expert e uses cdiv(g_e, m) = q_e + [r_e > 0] tiles, so
    all experts use sum(q_e) + j tiles. If j = 0 that is M/m. If j >= 1 then sum(r_e) >= 1,
    so cdiv(M, m) = sum(q_e) + cdiv(sum(r_e), m) >= sum(q_e) + 1 and the total is at most
    cdiv(M, m) - 1 + j <= cdiv(M, m) + E - 1. The bound is reached whenever every expert
    has a remainder and sum(r_e) <= m, e.g. loads [17, 1, 1, 1] with m = 8 use 3+1+1+1 = 6
    = cdiv(20, 8) + 4 - 1 tiles. Hence P = cdiv(M, m) + E - 1.
    """
    if tile_rows < 1:
        raise ValueError(f"tile_rows={tile_rows} must be >= 1")
    tiles = cdiv(num_assignments, tile_rows) + num_experts - 1
    return tiles, tiles * tile_rows


def _exclusive_cumsum(v_E: jax.Array) -> jax.Array:
    return jnp.cumsum(v_E) - v_E


# Counting sort (positions from per-expert counts: a cumsum over [M, E] one-hot ids) where E is
# at most this, else a stable argsort of the M ids. The plan's time, counting / argsort, on
# XLA:CPU (2 cores, 2026-12-06, ``python -m moe_train.bench --only permute``): 0.46x at E = 8
# (M = 4,096), 0.37x at E = 32 (M = 16,384), 2.7x at E = 128 (M = 32,768).
COUNTING_MAX_EXPERTS = 64


class Sorted(NamedTuple):
    """The M assignments sorted by expert (stable: token order within an expert)."""

    pos_M: jax.Array  # each assignment's position in the sorted order
    order_M: jax.Array  # the assignment at each sorted position (pos_M's inverse)
    group_sizes_E: jax.Array  # assignments per expert


def count_ids(ids: jax.Array, length: int) -> jax.Array:
    """[length] int32: how many of ``ids`` (any shape, values in [0, length)) are each value,
    by comparing every id with every value and summing: not ``bincount``, a scatter-add whose
    updates collide (a scatter of M values took 1.25 ms on a TPU v5e at Qwen3's shape)."""
    hits = ids.reshape(-1, 1).astype(jnp.int32) == jnp.arange(length, dtype=jnp.int32)
    return jnp.sum(hits, axis=0, dtype=jnp.int32)


def stable_order(ids_M: jax.Array, length: int) -> jax.Array:
    """[M] int32: the stable argsort of ``ids_M`` (values in [0, length)). Where an id and a
    position fit one int32 together, one sort of ``id << b | position`` (unique keys: no
    stability needed, and one operand where an argsort sorts two), the positions its low b
    bits; else ``jnp.argsort``."""
    M = ids_M.shape[0]
    bits = max(1, (M - 1).bit_length())
    if (max(1, length - 1)).bit_length() + bits > 31:
        return jnp.argsort(ids_M, stable=True).astype(jnp.int32)
    keys_M = (ids_M.astype(jnp.int32) << bits) | jnp.arange(M, dtype=jnp.int32)
    return jnp.sort(keys_M) & ((1 << bits) - 1)


def sorted_positions(experts_TK: jax.Array, num_experts: int, method: str = "auto") -> Sorted:
    """The assignments sorted by expert, both ways round, with one int32 scatter of M.

    ``method``: ``counting`` (each position is its expert's start plus the assignments of the
    same expert before it, from a cumsum of one-hot ids: no sort; the order by one scatter),
    ``argsort`` (a stable sort gives the order, ``stable_order``; the positions by one scatter), ``auto``:
    counting where E <= COUNTING_MAX_EXPERTS.
    """
    experts_M = experts_TK.reshape(-1).astype(jnp.int32)
    E, M = num_experts, experts_M.shape[0]
    arange_M = jnp.arange(M, dtype=jnp.int32)
    if method == "auto":
        method = "counting" if E <= COUNTING_MAX_EXPERTS else "argsort"
    if method == "counting":
        onehot_ME = (experts_M[:, None] == jnp.arange(E, dtype=jnp.int32)).astype(jnp.int32)
        seen_ME = jnp.cumsum(onehot_ME, axis=0)
        group_sizes_E = seen_ME[-1]
        rank_M = jnp.take_along_axis(seen_ME, experts_M[:, None], axis=1)[:, 0] - 1
        pos_M = _exclusive_cumsum(group_sizes_E)[experts_M] + rank_M
        order_M = jnp.zeros((M,), jnp.int32).at[pos_M].set(arange_M, unique_indices=True)
        return Sorted(pos_M, order_M, group_sizes_E)
    if method != "argsort":
        raise ValueError(f"unknown sort method {method!r}; one of auto, counting, argsort")
    order_M = stable_order(experts_M, E)
    group_sizes_E = count_ids(experts_M, E)
    pos_M = jnp.zeros((M,), jnp.int32).at[order_M].set(arange_M, unique_indices=True)
    return Sorted(pos_M, order_M, group_sizes_E)


def make_dispatch(
    experts_TK: jax.Array,
    num_experts: int,
    tile_rows: int | None = None,
    row_multiple: int = 1,
    method: str = "auto",
) -> Dispatch:
    """Plan for sorted rows (tile_rows=None: R = M rounded up to a multiple of ``row_multiple``,
    the rows after the M sorted ones zero and in no group) or the tiled layout (R = P*m).
    ``method``: how the assignments are sorted (``sorted_positions``). Sorted rows need no
    scatter beyond the sort's one (rows hold the sorted order); the tiled layout one more of
    M int32 (each row's assignment). Validity comes from the group spans."""
    T, K = experts_TK.shape
    M = T * K
    pos_M, order_M, group_sizes_E = sorted_positions(experts_TK, num_experts, method)
    if tile_rows is None:
        R, tile_expert_P, row_M = cdiv(M, row_multiple) * row_multiple, None, pos_M
        valid_R = jnp.arange(R, dtype=jnp.int32) < M
        slot_R = jnp.concatenate([order_M, jnp.full((R - M,), M, jnp.int32)])
    else:
        P, R = tiled_padding(M, num_experts, tile_rows)
        experts_M = experts_TK.reshape(-1).astype(jnp.int32)
        padded_start_E = _exclusive_cumsum(cdiv_array(group_sizes_E, tile_rows) * tile_rows)
        row_M = pos_M + (padded_start_E - _exclusive_cumsum(group_sizes_E))[experts_M]
        tile_expert_P = tile_experts(padded_start_E, P, tile_rows)
        owner_R = jnp.repeat(tile_expert_P, tile_rows, total_repeat_length=R)
        rank_R = jnp.arange(R, dtype=jnp.int32) - padded_start_E[owner_R]
        valid_R = (rank_R >= 0) & (rank_R < group_sizes_E[owner_R])
        arange_M = jnp.arange(M, dtype=jnp.int32)
        slot_R = jnp.full((R,), M, jnp.int32).at[row_M].set(arange_M, unique_indices=True)
    token_R = jnp.where(slot_R < M, slot_R // K, 0)
    return Dispatch(token_R, valid_R, row_M, group_sizes_E.astype(jnp.int32), tile_expert_P, slot_R)


def tile_experts(padded_start_E: jax.Array, num_tiles: int, tile_rows: int) -> jax.Array:
    """Expert owning each tile [P] int32.

    Tile b starts at row b*m; its owner is the last expert whose padded start is <= b*m
    (empty experts share their start with the next one and so never win). Trailing unused
    tiles, which hold only zero rows, get E-1.
    """
    E = padded_start_E.shape[0]
    tile_start_P = jnp.arange(num_tiles, dtype=jnp.int32) * tile_rows
    owner_P = jnp.searchsorted(padded_start_E, tile_start_P, side="right") - 1
    return jnp.clip(owner_P, 0, E - 1).astype(jnp.int32)


def zeros_after(shape, dtype, after: jax.Array) -> jax.Array:
    """Zeros of ``shape`` that XLA cannot make before ``after`` exists. A constant zero buffer
    (a loop carry's init, an accumulator) has no operands, and XLA:GPU's scheduler, below its
    memory limit, made such buffers early and held them (hoisted out of loops, fused side by
    side): deepseek-v3 at 4 layers held attention's dq accumulators, the [H, V] head
    gradient's and 21 of the tiled experts' [R, H] outputs at once (``make compile PEAK=1``).
    ``after * 0`` elementwise where the shapes match (0 also where ``after`` is not finite);
    else 0 from its first element, which must be on this device (inside shard_map, or
    replicated), or the partitioner moves it."""
    if tuple(after.shape) != tuple(shape):
        after = after.reshape(-1)[0]
    a = jax.lax.stop_gradient(after)
    zero = jnp.where(jnp.isfinite(a), jnp.abs(a) * 0, 0).astype(dtype)  # +0, not -0
    return jnp.broadcast_to(zero, shape) if zero.shape != tuple(shape) else zero


def take_rows(
    x_TH: jax.Array,
    index_R: jax.Array,
    valid_R: jax.Array,
    readers_TK: jax.Array,
    *,
    all_valid: bool = False,
    all_read: bool = False,
    dma: DmaRows | None = None,
) -> jax.Array:
    """``x_TH[index_R]`` [R, H] with zero rows where ``valid_R`` is False: a gather from
    ``x_TH`` with one zero row appended, which the invalid rows read. A gather followed by a
    select would hold an [R, H] select forward and another of the cotangent backward;
    XLA:GPU fused those of several overlap chunks into one multi-output kernel whose outputs
    were all live at once (deepseek-v3's MTP block: 16 of 448 MiB, ``make compile``).

    ``readers_TK``: the rows that read each source row (row ``r`` with ``valid_R[r]`` and
    ``index_R[r] == t`` is one of ``readers_TK[t]``; entries >= R stand for none), so the
    backward pass is a gather of the cotangent too, summed over K in fp32. Autodiff's
    backward, a scatter-add into a zero-filled [T, H] buffer, let XLA:GPU hoist those out of
    deepseek-v3's MTP block, 15 of 0.82 GiB live at once (``make compile PEAK=1``).

    ``all_valid`` (static): the caller knows every ``valid_R`` is True; ``all_read``: every
    reader is < R. Each drops its pass's zero row: appending it copies the whole source
    ([T+1, H] forward, the [R+1, H] cotangent backward), which on the TPU v5e cost a third of
    the gather itself at Qwen3's unpermute (``python -m moe_train.bench --accel``).
    ``dma``: with ``all_read``, the backward's gather and sum by row DMAs (``sum_gathered``)."""
    return _take_rows(all_valid, all_read, dma, x_TH, index_R, valid_R, readers_TK)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _take_rows(all_valid, all_read, dma, x_TH, index_R, valid_R, readers_TK):
    if all_valid:
        return x_TH[index_R]
    return _gather_padded(x_TH, jnp.where(valid_R, index_R, x_TH.shape[0]))


def _gather_padded(x_TH: jax.Array, index_R: jax.Array) -> jax.Array:
    """Rows ``index_R`` of ``x_TH`` with a zero row appended (index T: the zero row)."""
    padded = jnp.concatenate([x_TH, jnp.zeros((1, *x_TH.shape[1:]), x_TH.dtype)])
    return padded[index_R]


def _take_rows_fwd(all_valid, all_read, dma, x_TH, index_R, valid_R, readers_TK):
    return _take_rows(all_valid, all_read, dma, x_TH, index_R, valid_R, readers_TK), readers_TK


def _take_rows_bwd(all_valid, all_read, dma, readers_TK, g_RH):
    R, dtype = g_RH.shape[0], g_RH.dtype  # the cotangent has x's dtype, as the rows had
    if all_read:
        return sum_gathered(g_RH, readers_TK, dtype, dma), None, None, None
    picked_TKH = _gather_padded(g_RH, jnp.where(readers_TK < R, readers_TK, R))
    dx_TH = picked_TKH.astype(jnp.float32).sum(axis=1).astype(dtype)
    return dx_TH, None, None, None


_take_rows.defvjp(_take_rows_fwd, _take_rows_bwd)


def sum_gathered(src_RH: jax.Array, idx_TK: jax.Array, out_dtype, dma: DmaRows | None = None) -> jax.Array:
    """[T, H] of ``out_dtype``: ``sum_k src[idx[t, k]]`` in fp32, every index a row of ``src``:
    by row DMAs with ``dma`` (``moe_train.moe.dma_rows``), else XLA's gather."""
    if dma is not None:
        return gather_sum(src_RH, idx_TK, out_dtype, dma)
    return src_RH[idx_TK].astype(jnp.float32).sum(axis=1).astype(out_dtype)


def readers_of(slot_M: jax.Array, rows: int) -> jax.Array:
    """[rows, 1]: the one n whose ``slot_M[n]`` is each row (``len(slot_M)`` where none is):
    the readers of a gather by ``slot_M`` (``take_rows``)."""
    M = slot_M.shape[0]
    return (
        jnp.full((rows,), M, jnp.int32).at[slot_M].set(jnp.arange(M, dtype=jnp.int32), mode="drop")[:, None]
    )


def _sorted_unpadded(plan: Dispatch) -> bool:
    """Every dispatched row holds an assignment (sorted rows, none added for padding)."""
    return plan.tile_expert_P is None and plan.token_R.shape[0] == plan.row_M.shape[0]


def permute(x_TH: jax.Array, plan: Dispatch, dma: DmaRows | None = None) -> jax.Array:
    """Gather token rows into dispatch order [R, H]; padding rows are zero. Backward: the
    cotangent's rows of each token's K assignments, gathered and summed (every assignment has
    a row: no zero row appended), by row DMAs with ``dma``."""
    readers_TK = plan.row_M.reshape(x_TH.shape[0], -1)
    return take_rows(
        x_TH, plan.token_R, plan.valid_R, readers_TK, all_valid=_sorted_unpadded(plan), all_read=True, dma=dma
    )


def unpermute_sum(
    y_RH: jax.Array, plan: Dispatch, per_token: int, out_dtype, dma: DmaRows | None = None
) -> jax.Array:
    """[T, H] of ``out_dtype``: y[t] = sum_k y_R[row of (t, k)] in fp32, every assignment's row
    computed here (no spare group): ``unpermute`` and ``sum_rows`` in one step, by row DMAs with
    ``dma``. Backward: each row reads its token's cotangent (zero for padding rows)."""
    row_TK = plan.row_M.reshape(-1, per_token)
    kinds = (jnp.dtype(out_dtype), y_RH.dtype, _sorted_unpadded(plan), dma)
    return _unpermute_sum(kinds, y_RH, row_TK, plan.token_R, plan.valid_R)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _unpermute_sum(kinds, y_RH, row_TK, token_R, valid_R):
    out_dtype, _, _, dma = kinds
    return sum_gathered(y_RH, row_TK, out_dtype, dma)


def _unpermute_sum_fwd(kinds, y_RH, row_TK, token_R, valid_R):
    return _unpermute_sum(kinds, y_RH, row_TK, token_R, valid_R), (token_R, valid_R)


def _unpermute_sum_bwd(kinds, res, g_TH):
    _, rows_dtype, all_valid, _ = kinds
    token_R, valid_R = res
    g_TH = g_TH.astype(rows_dtype)
    g_RH = g_TH[token_R] if all_valid else _gather_padded(g_TH, jnp.where(valid_R, token_R, g_TH.shape[0]))
    return g_RH, None, None, None


_unpermute_sum.defvjp(_unpermute_sum_fwd, _unpermute_sum_bwd)


def weighted_sum(y_MH: jax.Array, weights_TK: jax.Array, out_dtype) -> jax.Array:
    """y[t] = sum_k weights[t, k] * y[t*K + k], summed in fp32."""
    T, K = weights_TK.shape
    y_TKH = y_MH.reshape(T, K, -1).astype(jnp.float32)
    return jnp.einsum("tkh,tk->th", y_TKH, weights_TK.astype(jnp.float32)).astype(out_dtype)


def row_values(v_M: jax.Array, plan: Dispatch) -> jax.Array:
    """[R] fp32: ``v_M[slot_R[r]]`` for the assignment each row holds, 0 where it holds none
    (slot M): a gather, not a scatter of M values by ``row_M`` (a scatter of M int32 took
    1.25 ms on a TPU v5e at Qwen3's shape, where the whole plan took 2.85 ms). Its gradient is
    a gather too, by each assignment's row (autodiff's would be a scatter-add by ``slot_R``)."""
    return _row_values(v_M.astype(jnp.float32), plan.slot_R, plan.row_M)


@jax.custom_vjp
def _row_values(v_M, slot_R, row_M):
    return jnp.concatenate([v_M, jnp.zeros((1,), v_M.dtype)])[slot_R]


def _row_values_fwd(v_M, slot_R, row_M):
    return _row_values(v_M, slot_R, row_M), row_M


def _row_values_bwd(row_M, g_R):
    return g_R[row_M], None, None


_row_values.defvjp(_row_values_fwd, _row_values_bwd)


def sum_rows(y_MH: jax.Array, per_token: int, out_dtype) -> jax.Array:
    """y[t] = sum_k y[t*K + k] (K = ``per_token``), summed in fp32."""
    y_TKH = y_MH.reshape(-1, per_token, y_MH.shape[-1]).astype(jnp.float32)
    return y_TKH.sum(axis=1).astype(out_dtype)


def unpermute(
    y_RH: jax.Array, plan: Dispatch, weights_TK: jax.Array | None = None, out_dtype=None, valid_M=None
) -> jax.Array:
    """Back to assignment order: y[t] = sum_k weights[t, k] * y_R[row of (t, k)] (fp32 sums);
    without weights, the row of every assignment n [M, H] as it is. ``valid_M`` (bool): the
    others read zero and pass no gradient back (rows no GEMM computed; None: all valid).
    Backward: a gather of the cotangent by each row's assignment (``plan.slot_R``)."""
    M, R = plan.row_M.shape[0], y_RH.shape[0]
    if valid_M is None:
        y_MH = take_rows(
            y_RH, plan.row_M, jnp.ones((M,), bool), plan.slot_R[:, None], all_valid=True, all_read=R == M
        )
    else:
        row_M = jnp.where(valid_M, plan.row_M, R)
        y_MH = take_rows(y_RH, row_M, valid_M, readers_of(row_M, R))
    if weights_TK is None:
        return y_MH
    return weighted_sum(y_MH, weights_TK, out_dtype or y_RH.dtype)
