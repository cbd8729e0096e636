"""Expert parallelism: the dropless MoE layer under ``shard_map`` with a token dispatcher.

Letter key: T this shard's tokens, H hidden, E experts, L local experts (E / P), K top-k,
P expert-parallel size, C receive slots per (source, destination) pair, N = T*K this shard's
assignments, R rows a shard computes.

Tokens are split over every mesh axis (``TOKEN_AXES``); experts over the expert axes
(``EP_AXES``, the product of ``expert_x`` (across fast-link domains) and ``expert`` (inside
one)). Each shard routes its own tokens; router statistics are reduced over the whole batch.
Dispatchers (all dropless when the step does not overflow; see ``capacity``):

- ``local``: P = 1, no exchange.
- ``allgather``: gather every token of the EP group, run the local experts on the ones
  routed to them, reduce-scatter the partial outputs back. Static, never overflows.
- ``a2a``: send each assignment only to the shard holding its expert, in fixed-size slots of
  C rows per (source, destination) pair; exchange counts first, run, send back. A pair with
  more than C assignments sets the ``overflow`` flag: the train step then keeps its old state
  and the loop reruns the step with a larger C (never dropping a token).
"""

from __future__ import annotations

import dataclasses
import math
from functools import partial

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from moe_train.moe.gemm import grouped_swiglu, resolve_backend
from moe_train.moe.layer import default_tile_rows
from moe_train.moe.permute import make_dispatch, permute
from moe_train.moe.router import route, router_logits, router_stats
from moe_train.sharding import EP_AXES, TOKEN_AXES

DISPATCHERS = ("local", "allgather", "a2a")


@dataclasses.dataclass(frozen=True)
class EPPlan:
    """Static choices of one compiled step's MoE layers."""

    dispatcher: str  # local | allgather | a2a
    ep: int  # expert-parallel size P
    capacity_factor: float | None = None  # a2a slots per pair, x balanced load; None: worst case
    chunks: int = 1  # dispatch the tokens in this many sequential chunks


def capacity(plan: EPPlan, assignments: int, top_k: int, local_experts: int) -> int:
    """Slots C per (source, destination) pair for N = ``assignments`` of one shard.

    The worst case is every token sending min(K, L) assignments to one destination. Buckets
    are ``capacity_factor`` times the balanced load N / P, rounded up to a multiple of 8.
    """
    worst = assignments // top_k * min(top_k, local_experts)
    if plan.capacity_factor is None:
        return worst
    balanced = plan.capacity_factor * assignments / plan.ep
    return min(worst, 8 * math.ceil(balanced / 8))


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


def _no_exchange_stats(n: int) -> dict:
    return {"overflow": jnp.zeros((), bool), "recv_rows": jnp.float32(n),
            "recv_slots": jnp.float32(n), "max_pair_rows": jnp.int32(0)}


def _local(x_TH, weights_TK, experts_TK, w, plan, backend, tile_rows):
    y_NH = expert_rows(x_TH, experts_TK, *w, backend, tile_rows)
    return combine(y_NH, weights_TK, x_TH.dtype), _no_exchange_stats(experts_TK.size)


def _allgather(x_TH, weights_TK, experts_TK, w, plan, backend, tile_rows):
    L = w[0].shape[0]
    rank = jax.lax.axis_index(EP_AXES)
    x_GH = jax.lax.all_gather(x_TH, EP_AXES, tiled=True)
    e_GK = jax.lax.all_gather(experts_TK, EP_AXES, tiled=True)
    w_GK = jax.lax.all_gather(weights_TK, EP_AXES, tiled=True)
    mine_GK = e_GK // L == rank
    ids_GK = jnp.where(mine_GK, e_GK % L, L)
    y_NH = expert_rows(x_GH, ids_GK, *w, backend, tile_rows)
    part_GH = combine(y_NH, jnp.where(mine_GK, w_GK, 0.0), jnp.float32)
    y_TH = jax.lax.psum_scatter(part_GH, EP_AXES, scatter_dimension=0, tiled=True)
    stats = _no_exchange_stats(e_GK.size)
    stats["recv_rows"] = jnp.sum(mine_GK).astype(jnp.float32)
    return y_TH.astype(x_TH.dtype), stats


def _slots(experts_N, L: int, P_: int, C: int):
    """Slot of each assignment in the send buffer [P*C] (P*C where it does not fit)."""
    N = experts_N.shape[0]
    dest_N = experts_N // L
    order_N = jnp.argsort(experts_N, stable=True)
    counts_P = jnp.bincount(dest_N, length=P_).astype(jnp.int32)
    start_P = jnp.cumsum(counts_P) - counts_P
    pos_sorted = jnp.arange(N, dtype=jnp.int32) - start_P[dest_N[order_N]]
    pos_N = jnp.zeros((N,), jnp.int32).at[order_N].set(pos_sorted)
    slot_N = jnp.where(pos_N < C, dest_N * C + pos_N, P_ * C)
    return slot_N, counts_P


def _a2a(x_TH, weights_TK, experts_TK, w, plan, backend, tile_rows):
    T, K = experts_TK.shape
    L, H = w[0].shape[0], x_TH.shape[1]
    C = capacity(plan, T * K, K, L)
    e_N = experts_TK.reshape(-1)
    slot_N, counts_P = _slots(e_N, L, plan.ep, C)
    send_x = jnp.zeros((plan.ep * C, H), x_TH.dtype).at[slot_N].set(
        jnp.repeat(x_TH, K, axis=0), mode="drop")
    send_id = jnp.full((plan.ep * C,), L, jnp.int32).at[slot_N].set(e_N % L, mode="drop")
    a2a = partial(jax.lax.all_to_all, axis_name=EP_AXES, split_axis=0, concat_axis=0, tiled=True)
    recv_counts_P = a2a(counts_P)  # what every source wants to send here
    recv_x, recv_id = a2a(send_x), a2a(send_id)
    y_recv = expert_rows(recv_x, recv_id[:, None], *w, backend, tile_rows)
    y_back = a2a(y_recv)
    y_NH = jnp.where((slot_N < plan.ep * C)[:, None], y_back[jnp.minimum(slot_N, plan.ep * C - 1)], 0)
    stats = {"overflow": jnp.any(recv_counts_P > C),
             "recv_rows": jnp.sum(jnp.minimum(recv_counts_P, C)).astype(jnp.float32),
             "recv_slots": jnp.float32(plan.ep * C), "max_pair_rows": jnp.max(recv_counts_P)}
    return combine(y_NH, weights_TK, x_TH.dtype), stats


_DISPATCH = {"local": _local, "allgather": _allgather, "a2a": _a2a}


def _chunked(fn, x_TH, weights_TK, experts_TK, w, plan, backend, tile_rows):
    """Run ``fn`` on ``plan.chunks`` consecutive token chunks (independent exchanges)."""
    n = plan.chunks
    if n == 1:
        return fn(x_TH, weights_TK, experts_TK, w, plan, backend, tile_rows)
    outs = [fn(x, wt, ex, w, plan, backend, tile_rows) for x, wt, ex in
            zip(jnp.split(x_TH, n), jnp.split(weights_TK, n), jnp.split(experts_TK, n))]
    stats = {"overflow": jnp.any(jnp.stack([s["overflow"] for _, s in outs])),
             "recv_rows": sum(s["recv_rows"] for _, s in outs),
             "recv_slots": sum(s["recv_slots"] for _, s in outs),
             "max_pair_rows": jnp.max(jnp.stack([s["max_pair_rows"] for _, s in outs]))}
    return jnp.concatenate([y for y, _ in outs]), stats


def ep_moe(x_TH, gate_kernel_HE, wi_0_EHF, wi_1_EHF, wo_EFH, *, plan: EPPlan, top_k: int,
           score_function="softmax", normalize_top_k=True, num_groups=None, group_top_k=None,
           routed_scaling=1.0, expert_bias=None, backend="auto", tile_rows=None, seq_len=None):
    """``dropless_moe`` on the context mesh: same arguments and result, plus exchange stats.

    ``x_TH`` is the global token batch (split over TOKEN_AXES), expert weights are split over
    EP_AXES. Extra stats: ``overflow`` (some a2a pair needed more than C slots: rerun the step
    with a larger bucket), ``recv_rows`` and ``recv_slots`` (rows received vs. buffer rows,
    summed over shards), ``max_pair_rows`` (the largest a2a pair load, to size buckets).
    """
    E, H, F = wi_0_EHF.shape
    name = resolve_backend(backend, x_TH.dtype, hidden=H, ffn=F)
    # One tile size for every buffer size, so a bucket computes exactly what the worst case
    # does; a shard receives T*K rows when routing is balanced.
    shard_rows = x_TH.shape[0] // math.prod(jax.sharding.get_abstract_mesh().shape.values()) * top_k
    tile_rows = tile_rows or default_tile_rows(shard_rows // plan.chunks, E // plan.ep)
    bias_E = jnp.zeros((E,), jnp.float32) if expert_bias is None else expert_bias
    route_kw = dict(score_function=score_function, normalize_top_k=normalize_top_k,
                    num_groups=num_groups or None, group_top_k=group_top_k or None,
                    routed_scaling=routed_scaling)

    def shard(x_TH, gate_HE, w0, w1, wo, bias_E):
        with jax.named_scope("route"):
            logits_TE = router_logits(x_TH, gate_HE)
            weights_TK, experts_TK, scores_TE = route(logits_TE, top_k, expert_bias=bias_E,
                                                      **route_kw)
            stats = router_stats(logits_TE, scores_TE, experts_TK, score_function=score_function,
                                 seq_len=seq_len, axis_names=TOKEN_AXES)
        with jax.named_scope(f"dispatch_{plan.dispatcher}"):
            y_TH, ex = _chunked(_DISPATCH[plan.dispatcher], x_TH, weights_TK, experts_TK,
                                (w0, w1, wo), plan, name, tile_rows)
        stats["overflow"] = jax.lax.pmax(ex["overflow"].astype(jnp.int32), TOKEN_AXES) > 0
        stats["recv_rows"] = jax.lax.psum(ex["recv_rows"], TOKEN_AXES)
        stats["recv_slots"] = jax.lax.psum(ex["recv_slots"], TOKEN_AXES)
        stats["max_pair_rows"] = jax.lax.pmax(ex["max_pair_rows"], TOKEN_AXES)
        return y_TH, stats

    tokens, experts = P(TOKEN_AXES, None), P(EP_AXES, None, None)
    stat_specs = {k: P() for k in ("tokens_per_expert", "dropped_tokens", "aux_loss",
                                   "seq_aux_loss", "z_loss", "router_entropy", "overflow",
                                   "recv_rows", "recv_slots", "max_pair_rows")}
    fn = jax.shard_map(shard, in_specs=(tokens, P(), experts, experts, experts, P()),
                       out_specs=(tokens, stat_specs))
    return fn(x_TH, gate_kernel_HE, wi_0_EHF, wi_1_EHF, wo_EFH, bias_E)
