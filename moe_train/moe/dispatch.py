"""Token dispatchers for expert parallelism; each runs inside ``shard_map`` on one shard.

Letter key: T this shard's tokens, H hidden, K top-k, L local experts, P EP size, G fast-link
domains in the EP group (mesh axis ``expert_x``), D shards per domain (axis ``expert``),
C slots per (source, destination) pair, N = T*K assignments, R rows of a buffer.

Every dispatcher returns ``(y_TH, stats)``; stats: ``overflow`` (a pair needed more than C
slots; the step must be rerun with a larger bucket), ``recv_rows``/``recv_slots`` (rows
received vs. receive-buffer rows), ``max_pair_load`` (largest pair load / balanced load, for
stepping buckets down) and ``slow_rows`` (token rows this shard sends to other domains, one
way; bytes = rows * H * itemsize, twice per exchange: dispatch and combine).
"""

from __future__ import annotations

import math
from functools import partial

import jax
import jax.numpy as jnp

from moe_train.moe.gemm import grouped_swiglu
from moe_train.moe.permute import make_dispatch, permute
from moe_train.sharding import EP_AXES


def bucket_slots(factor: float | None, balanced: float, worst: int) -> int:
    """Slots for a capacity ``factor`` x ``balanced`` load (multiple of 8), capped at ``worst``."""
    if factor is None:
        return worst
    return max(1, min(worst, 8 * math.ceil(factor * balanced / 8)))


def expert_rows(x_SH, ids_SK, w0_LHF, w1_LHF, wo_LFH, backend: str, tile_rows: int):
    """SwiGLU of local expert ``ids[s, k]`` on row ``x[s]`` for every (s, k) -> [S*K, H].

    An id of L means "no local expert": that row's output is unspecified and must get a zero
    combine weight (it is computed in padding tiles, or skipped by ragged backends).
    """
    L = w0_LHF.shape[0]
    plan = make_dispatch(ids_SK, L + 1, tile_rows if backend == "tiled" else None)
    tiles = None if plan.tile_expert_B is None else jnp.minimum(plan.tile_expert_B, L - 1)
    plan = plan._replace(group_sizes_E=plan.group_sizes_E[:L], tile_expert_B=tiles)
    y_RH = grouped_swiglu(permute(x_SH, plan), plan, w0_LHF, w1_LHF, wo_LFH, backend)
    return y_RH[plan.row_N]


def combine(y_NH, weights_TK, out_dtype):
    """y[t] = sum_k weights[t, k] * y[t*K + k], in fp32."""
    T, K = weights_TK.shape
    y_TKH = y_NH.reshape(T, K, -1).astype(jnp.float32)
    return jnp.einsum("tkh,tk->th", y_TKH, weights_TK.astype(jnp.float32)).astype(out_dtype)


def _stats(n: int, **kw) -> dict:
    base = {"overflow": jnp.zeros((), bool), "recv_rows": jnp.float32(n),
            "recv_slots": jnp.float32(n), "max_pair_load": jnp.float32(0),
            "slow_rows": jnp.float32(0)}
    base.update(kw)
    return base


def local(x_TH, weights_TK, experts_TK, w, ctx):
    """EP size 1: every expert is here."""
    y_NH = expert_rows(x_TH, experts_TK, *w, ctx.backend, ctx.tile_rows)
    return combine(y_NH, weights_TK, x_TH.dtype), _stats(experts_TK.size)


def allgather(x_TH, weights_TK, experts_TK, w, ctx):
    """Gather the EP group's tokens, run the local experts, reduce-scatter partial outputs."""
    L = w[0].shape[0]
    rank = jax.lax.axis_index(EP_AXES)
    x_GH = jax.lax.all_gather(x_TH, EP_AXES, tiled=True)
    e_GK = jax.lax.all_gather(experts_TK, EP_AXES, tiled=True)
    w_GK = jax.lax.all_gather(weights_TK, EP_AXES, tiled=True)
    mine_GK = e_GK // L == rank
    y_NH = expert_rows(x_GH, jnp.where(mine_GK, e_GK % L, L), *w, ctx.backend, ctx.tile_rows)
    part_GH = combine(y_NH, jnp.where(mine_GK, w_GK, 0.0), jnp.float32)
    y_TH = jax.lax.psum_scatter(part_GH, EP_AXES, scatter_dimension=0, tiled=True)
    remote = x_TH.shape[0] * (ctx.domains - 1) * ctx.domain_size  # tokens gathered from other domains
    return y_TH.astype(x_TH.dtype), _stats(e_GK.size, recv_rows=jnp.sum(mine_GK).astype(jnp.float32),
                                           slow_rows=jnp.float32(remote))


def _slots(dest_N, local_N, L: int, n_dest: int, C: int):
    """Send-buffer slot [n_dest*C] of each assignment (n_dest*C: not sent) and counts per dest.

    ``dest_N == n_dest`` marks assignments that stay out of this exchange.
    """
    N = dest_N.shape[0]
    order_N = jnp.argsort(dest_N * L + local_N, stable=True)
    counts = jnp.bincount(dest_N, length=n_dest + 1).astype(jnp.int32)
    start = jnp.cumsum(counts) - counts
    pos_N = jnp.zeros((N,), jnp.int32).at[order_N].set(
        jnp.arange(N, dtype=jnp.int32) - start[dest_N[order_N]])
    ok_N = (dest_N < n_dest) & (pos_N < C)
    return jnp.where(ok_N, dest_N * C + pos_N, n_dest * C), counts[:n_dest]


def exchange(x_SH, weights_SK, dest_SK, local_SK, n_dest: int, C: int, axis, w, ctx, balanced,
             out_dtype):
    """Send assignment (s, k) to shard ``dest[s, k]`` along ``axis``, run local expert
    ``local[s, k]`` there, return and combine. ``dest == n_dest``: not sent, weight 0."""
    S, K = dest_SK.shape
    L, H, R = w[0].shape[0], x_SH.shape[1], n_dest * C
    local_N = jnp.where(dest_SK < n_dest, local_SK, 0).reshape(-1)
    slot_N, counts = _slots(dest_SK.reshape(-1), local_N, L, n_dest, C)
    send_x = jnp.zeros((R, H), x_SH.dtype).at[slot_N].set(jnp.repeat(x_SH, K, axis=0), mode="drop")
    send_id = jnp.full((R,), L, jnp.int32).at[slot_N].set(local_N, mode="drop")
    a2a = partial(jax.lax.all_to_all, axis_name=axis, split_axis=0, concat_axis=0, tiled=True)
    recv_counts = a2a(counts)  # the small exchange: what every source sends here
    y_recv = expert_rows(a2a(send_x), a2a(send_id)[:, None], *w, ctx.backend, ctx.tile_rows)
    y_back = a2a(y_recv)
    y_NH = jnp.where((slot_N < R)[:, None], y_back[jnp.minimum(slot_N, R - 1)], 0)
    stats = _stats(0, overflow=jnp.any(recv_counts > C),
                   recv_rows=jnp.sum(jnp.minimum(recv_counts, C)).astype(jnp.float32),
                   recv_slots=jnp.float32(R),
                   max_pair_load=jnp.max(recv_counts).astype(jnp.float32) / balanced)
    return combine(y_NH, jnp.where(dest_SK < n_dest, weights_SK, 0.0), out_dtype), stats


def a2a(x_TH, weights_TK, experts_TK, w, ctx):
    """Flat all-to-all over the whole EP group: each assignment goes straight to its expert."""
    T, K = experts_TK.shape
    L, P = w[0].shape[0], ctx.plan.ep
    balanced = T * K / P
    C = bucket_slots(ctx.plan.capacity_factor, balanced, T * min(K, L))
    dest_TK = experts_TK // L
    y_TH, stats = exchange(x_TH, weights_TK, dest_TK, experts_TK % L, P, C, EP_AXES, w, ctx,
                           balanced, x_TH.dtype)
    domain = jax.lax.axis_index("expert_x")
    stats["slow_rows"] = jnp.sum(dest_TK // ctx.domain_size != domain).astype(jnp.float32)
    return y_TH, stats


def hierarchical(x_TH, weights_TK, experts_TK, w, ctx):
    """Two stages: each token crosses to every remote domain holding one of its experts once
    (axis ``expert_x``, the slow links), then fans out inside the domain (axis ``expert``).
    Combine runs in reverse: domain partial sums come back over the slow links once per token."""
    T, K = experts_TK.shape
    L, H, G, D = w[0].shape[0], x_TH.shape[1], ctx.domains, ctx.domain_size
    factor = ctx.plan.capacity_factor
    dom_TK = experts_TK // (L * D)
    need_TG = jnp.any(dom_TK[:, :, None] == jnp.arange(G), axis=1)
    hit = 1.0 - (1.0 - 1.0 / G) ** K  # chance a token uses a given domain, uniform routing
    C1 = bucket_slots(factor, T * hit, T)
    R1 = G * C1
    pos_TG = jnp.cumsum(need_TG, axis=0, dtype=jnp.int32) - 1
    ok_TG = need_TG & (pos_TG < C1)
    slot = jnp.where(ok_TG, jnp.arange(G) * C1 + pos_TG, R1).reshape(-1)
    in_dom_TGK = dom_TK[:, None, :] == jnp.arange(G)[None, :, None]
    send_x = jnp.zeros((R1, H), x_TH.dtype).at[slot].set(jnp.repeat(x_TH, G, axis=0), mode="drop")
    send_e = jnp.full((R1, K), -1, jnp.int32).at[slot].set(
        jnp.where(in_dom_TGK, experts_TK[:, None, :], -1).reshape(T * G, K), mode="drop")
    send_w = jnp.zeros((R1, K), jnp.float32).at[slot].set(
        jnp.where(in_dom_TGK, weights_TK[:, None, :], 0.0).reshape(T * G, K), mode="drop")
    a2a1 = partial(jax.lax.all_to_all, axis_name="expert_x", split_axis=0, concat_axis=0, tiled=True)
    recv_counts1 = a2a1(need_TG.sum(axis=0).astype(jnp.int32))
    r_e = a2a1(send_e)
    dest2 = jnp.where(r_e >= 0, (r_e // L) % D, D)
    C2 = bucket_slots(factor, T * K / D, R1 * min(K, L))
    part_RH, stats = exchange(a2a1(send_x), a2a1(send_w), dest2, r_e % L, D, C2, "expert", w, ctx,
                              T * K / D, jnp.float32)
    back_RH = a2a1(part_RH)
    y_TGH = jnp.where(ok_TG[..., None], back_RH[jnp.minimum(slot, R1 - 1)].reshape(T, G, H), 0)
    domain = jax.lax.axis_index("expert_x")
    stats["overflow"] = stats["overflow"] | jnp.any(recv_counts1 > C1)
    stats["max_pair_load"] = jnp.maximum(stats["max_pair_load"], jnp.max(recv_counts1) / (T * hit))
    stats["slow_rows"] = (need_TG.sum() - need_TG[:, domain].sum()).astype(jnp.float32)
    return y_TGH.sum(axis=1).astype(x_TH.dtype), stats


DISPATCHERS = {"local": local, "allgather": allgather, "a2a": a2a, "hierarchical": hierarchical}
