"""Expert parallelism: the dropless MoE layer under ``shard_map`` with a token dispatcher.

Letter key: T this shard's tokens, H hidden, E experts, K top-k, P expert-parallel size.

Tokens are split over every mesh axis (``TOKEN_AXES``); experts over the expert axes
(``EP_AXES``: ``expert_x`` across fast-link domains times ``expert`` inside one). Each shard
routes its own tokens; router statistics are reduced over the whole batch. The dispatchers
(``moe_train.moe.dispatch``): ``local`` (P = 1), ``allgather``, ``a2a`` (flat all-to-all in
capacity-bucketed slots) and ``hierarchical`` (two-stage, each token crosses the slow links
once per remote domain). A bucketed exchange that does not fit sets ``overflow``; the train
step then keeps its old state and the loop reruns it on a larger bucket: no token is dropped.
"""

from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from moe_train.moe.dispatch import DISPATCHERS
from moe_train.moe.gemm import resolve_backend
from moe_train.moe.layer import default_tile_rows
from moe_train.moe.router import route, router_logits, router_stats
from moe_train.sharding import EP_AXES, TOKEN_AXES


@dataclasses.dataclass(frozen=True)
class EPPlan:
    """Static choices of one compiled step's MoE layers."""

    dispatcher: str  # local | allgather | a2a | hierarchical
    ep: int  # expert-parallel size P
    capacity_factor: float | None = None  # buffer slots per pair, x balanced load; None: worst
    chunks: int = 1  # dispatch the tokens in this many sequential chunks


class Context(NamedTuple):
    """Static facts a dispatcher needs besides its operands."""

    plan: EPPlan
    backend: str  # concrete grouped-GEMM backend
    tile_rows: int  # tile of the tiled backend, the same for every buffer size
    domains: int  # G: fast-link domains in an EP group (mesh axis expert_x)
    domain_size: int  # D: shards per domain (mesh axis expert)


def _chunked(fn, x_TH, weights_TK, experts_TK, w, ctx: Context):
    """Run ``fn`` on ``plan.chunks`` consecutive token chunks (independent exchanges that
    XLA's latency-hiding scheduler can overlap with the other chunks' expert GEMMs)."""
    n = ctx.plan.chunks
    if n == 1:
        return fn(x_TH, weights_TK, experts_TK, w, ctx)
    outs = [fn(x, wt, ex, w, ctx) for x, wt, ex in
            zip(jnp.split(x_TH, n), jnp.split(weights_TK, n), jnp.split(experts_TK, n))]
    stats = {k: sum(s[k] for _, s in outs) for k in ("recv_rows", "recv_slots", "slow_rows")}
    stats["overflow"] = jnp.any(jnp.stack([s["overflow"] for _, s in outs]))
    stats["max_pair_load"] = jnp.max(jnp.stack([s["max_pair_load"] for _, s in outs]))
    return jnp.concatenate([y for y, _ in outs]), stats


def ep_moe(x_TH, gate_kernel_HE, wi_0_EHF, wi_1_EHF, wo_EFH, *, plan: EPPlan, top_k: int,
           score_function="softmax", normalize_top_k=True, num_groups=None, group_top_k=None,
           routed_scaling=1.0, expert_bias=None, backend="auto", tile_rows=None, seq_len=None,
           expert_input=None):
    """``dropless_moe`` on the context mesh: same arguments and result, plus exchange stats.

    ``x_TH`` is the global token batch (split over TOKEN_AXES), expert weights are split over
    EP_AXES. Extra stats: ``overflow`` (some a2a pair needed more than C slots: rerun the step
    with a larger bucket), ``recv_rows`` and ``recv_slots`` (rows received vs. buffer rows,
    summed over shards), ``max_pair_load`` (largest pair load / balanced load, to size
    buckets) and ``slow_rows`` (token rows sent across domains, one way, summed over shards).
    ``expert_input`` (like ``dropless_moe``'s): the rows dispatched to the experts in place of
    ``x_TH``, split like it; the router sees ``x_TH``.
    """
    E, H, F = wi_0_EHF.shape
    name = resolve_backend(backend, x_TH.dtype, hidden=H, ffn=F)
    # One tile size for every buffer size, so a bucket computes exactly what the worst case
    # does; a shard receives T*K rows when routing is balanced.
    mesh = jax.sharding.get_abstract_mesh().shape
    shard_rows = x_TH.shape[0] // math.prod(mesh.values()) * top_k
    ctx = Context(plan, name, tile_rows or default_tile_rows(shard_rows // plan.chunks, E // plan.ep),
                  mesh["expert_x"], mesh["expert"])
    bias_E = jnp.zeros((E,), jnp.float32) if expert_bias is None else expert_bias
    route_kw = dict(score_function=score_function, normalize_top_k=normalize_top_k,
                    num_groups=num_groups or None, group_top_k=group_top_k or None,
                    routed_scaling=routed_scaling)

    def shard(x_TH, xe_TH, gate_HE, w0, w1, wo, bias_E):
        with jax.named_scope("route"):
            logits_TE = router_logits(x_TH, gate_HE)
            weights_TK, experts_TK, scores_TE = route(logits_TE, top_k, expert_bias=bias_E,
                                                      **route_kw)
            stats = router_stats(logits_TE, scores_TE, experts_TK, score_function=score_function,
                                 seq_len=seq_len, axis_names=TOKEN_AXES)
        with jax.named_scope(f"dispatch_{plan.dispatcher}"):
            y_TH, ex = _chunked(DISPATCHERS[plan.dispatcher], xe_TH, weights_TK, experts_TK,
                                (w0, w1, wo), ctx)
        stats["overflow"] = jax.lax.pmax(ex["overflow"].astype(jnp.int32), TOKEN_AXES) > 0
        stats["max_pair_load"] = jax.lax.pmax(ex["max_pair_load"], TOKEN_AXES)
        for key in ("recv_rows", "recv_slots", "slow_rows"):
            stats[key] = jax.lax.psum(ex[key], TOKEN_AXES)
        return y_TH, stats

    tokens, experts = P(TOKEN_AXES, None), P(EP_AXES, None, None)
    stat_specs = {k: P() for k in ("tokens_per_expert", "dropped_tokens", "aux_loss",
                                   "seq_aux_loss", "z_loss", "router_entropy", "overflow",
                                   "recv_rows", "recv_slots", "max_pair_load", "slow_rows")}
    fn = jax.shard_map(shard, in_specs=(tokens, tokens, P(), experts, experts, experts, P()),
                       out_specs=(tokens, stat_specs))
    xe_TH = x_TH if expert_input is None else expert_input
    return fn(x_TH, xe_TH, gate_kernel_HE, wi_0_EHF, wi_1_EHF, wo_EFH, bias_E)
