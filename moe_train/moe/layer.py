"""The dropless MoE layer: one pipeline of named steps for every expert-parallel size.

Shape letters (``moe_train.base.notation``): T tokens, H hidden, E experts (inside ``shard_map``:
this shard's), F expert ffn, K top-k (the expert ids an arriving row carries), M = T*K
assignments, A rows arriving at a shard, R dispatched rows; m tile rows (a scalar).

    route -> dispatch -> permute -> grouped_gemm -> unpermute -> combine

``route`` picks each token's experts and weights (``moe_train.moe.router``); ``dispatch``
sends the tokens to the shards holding their experts (``moe_train.moe.dispatch``: one file
per dispatcher); ``permute`` groups the rows that arrived by local expert; ``grouped_gemm``
runs every expert's SwiGLU on its rows (``moe_train.moe.gemm``), each row's activation scaled
by its combine weight where those arrived (before ``wo``: the weights' gradient then needs
only what the GEMMs' own backward keeps, and the combine after it is linear, so a
recomputing ``train.remat`` repeats no combine); ``unpermute`` puts the results back in
arrival order, each row's K results summed; ``combine`` is the dispatch's inverse. Every
dispatcher implements one contract (``moe_train.moe.dispatch.contract.Dispatcher``):
``dispatch`` returns the rows that arrived (``Arrived``) and its own metadata type, which its
``combine`` takes back. ``dropless_moe`` runs it on one device or, given an ``EPPlan``, on
every shard under ``shard_map``; with one shard (no plan, or an EP group of size 1) dispatch
and combine are identities. Each step runs under ``jax.named_scope`` of its name, so a
profile shows the same phases whatever the EP size.

Every assignment is computed (no capacity, no dropping). Shapes are static: routing only
changes array values, so a jitted layer compiles once and never syncs with the host.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from moe_train.base.platform import Platform, or_here
from moe_train.moe import dma_rows, megablox
from moe_train.moe import stats as moe_stats
from moe_train.moe.dispatch import Arrived, Context, Dispatcher, ExchangeStats, Local, dispatcher
from moe_train.moe.gemm import grouped_swiglu, resolve_backend
from moe_train.moe.permute import make_dispatch, permute, row_values, sum_rows, unpermute, unpermute_sum
from moe_train.moe.router import Routing, route_tokens
from moe_train.moe.tiled import default_tile_rows
from moe_train.parallel.jobplan import EPPlan
from moe_train.parallel.sharding import EXPERT, EXPERT_X, TOKEN_AXES, logical_spec


def check_expert_shapes(x_TH, gate_kernel_HE, wi_0_EHF, wi_1_EHF, wo_EFH) -> tuple[int, int, int]:
    """Validate operand shapes; returns (H, E, F)."""
    H = x_TH.shape[-1]
    if gate_kernel_HE.ndim != 2 or gate_kernel_HE.shape[0] != H:
        raise ValueError(f"gate kernel must be [H={H}, E], got {gate_kernel_HE.shape}")
    E = gate_kernel_HE.shape[1]
    if wi_0_EHF.ndim != 3 or wi_0_EHF.shape[:2] != (E, H):
        raise ValueError(f"wi_0 must be [E={E}, H={H}, F], got {wi_0_EHF.shape}")
    F = wi_0_EHF.shape[2]
    if wi_1_EHF.shape != (E, H, F) or wo_EFH.shape != (E, F, H):
        raise ValueError(
            f"expected wi_1 {(E, H, F)} and wo {(E, F, H)}, got {wi_1_EHF.shape} and {wo_EFH.shape}"
        )
    return H, E, F


class Experts(NamedTuple):
    """The SwiGLU experts of one shard (the backends compute in the rows' dtype)."""

    wi_0_EHF: jax.Array
    wi_1_EHF: jax.Array
    wo_EFH: jax.Array
    backend: str  # concrete grouped-GEMM backend
    tile_rows: int | None  # rows per tile of the tiled backend; None: sorted rows
    row_tile: int = 1  # sorted rows are padded to a multiple of this (megablox's row tile)
    platform: Platform | None = None  # the target the kernels are built for (None: this process's)


def row_tiles(
    backend: str, tile_rows: int | None, rows: int, experts: int, platform: Platform | None = None
) -> tuple[int | None, int]:
    """(tile_rows, row_tile) of ``Experts`` for ``rows`` assignments to ``experts``: the tiled
    backend's tile (``tile_rows`` or its default on ``platform``); megablox's row tile on
    sorted rows, or with ``tile_rows`` each group padded to it (the tiled layout) and it the
    row tile; else (None, 1)."""
    if backend == "tiled":
        return tile_rows or default_tile_rows(rows, experts, or_here(platform).name), 1
    if backend == "megablox" and tile_rows:
        if tile_rows % megablox.MIN_ROW_TILE:
            raise ValueError(
                f"moe.tile_rows={tile_rows}: megablox needs a multiple of {megablox.MIN_ROW_TILE}"
            )
        return tile_rows, tile_rows
    if backend == "megablox":
        return None, megablox.default_row_tile(rows, experts)
    return None, 1


def expert_steps(arrived: Arrived, experts: Experts) -> jax.Array:
    """permute -> grouped_gemm -> unpermute on the rows that arrived at this shard. On a TPU
    the gathers that sum a token's rows (the unpermute, the permute's backward) run by row
    DMAs (``dma_rows``)."""
    E = experts.wi_0_EHF.shape[0]
    dma = dma_rows.for_target(or_here(experts.platform), arrived.x_AH)
    with jax.named_scope("permute"):
        plan = make_dispatch(arrived.ids_AK, E + arrived.spare, experts.tile_rows, experts.row_tile)
        if arrived.spare:  # id E (not here) is an extra group that no GEMM reads
            tiles = None if plan.tile_expert_P is None else jnp.minimum(plan.tile_expert_P, E - 1)
            plan = plan._replace(group_sizes_E=plan.group_sizes_E[:E], tile_expert_P=tiles)
        x_RH = permute(arrived.x_AH, plan, dma)
        w_AK = arrived.weights_AK
        w_R = None if w_AK is None else row_values(w_AK.reshape(-1), plan)
    with jax.named_scope("grouped_gemm"):
        w0, w1, wo = experts.wi_0_EHF, experts.wi_1_EHF, experts.wo_EFH
        y_RH = grouped_swiglu(
            x_RH,
            plan,
            w0,
            w1,
            wo,
            experts.backend,
            scale_R=w_R,
            row_tile=experts.row_tile,
            platform=experts.platform,
            all_grouped=not arrived.spare and x_RH.shape[0] == plan.row_M.shape[0],
        )
    with jax.named_scope("unpermute"):
        if w_AK is not None and not arrived.spare:
            return unpermute_sum(y_RH, plan, w_AK.shape[1], arrived.out_dtype, dma)
        # assignments to no expert here (the spare id E) read zero, not the rows no GEMM wrote
        valid_M = arrived.ids_AK.reshape(-1) < E if arrived.spare else None
        y_MH = unpermute(y_RH, plan, valid_M=valid_M)
        return y_MH if w_AK is None else sum_rows(y_MH, w_AK.shape[1], arrived.out_dtype)


def exchange_steps(
    exchange: Dispatcher, x_TH, weights_TK, experts_TK, experts: Experts, chunks: int = 1
) -> tuple[jax.Array, ExchangeStats]:
    """dispatch -> expert steps -> combine, on ``chunks`` consecutive token chunks (independent
    exchanges that XLA's scheduler can overlap with the other chunks' GEMMs): (y_TH, stats)."""
    if chunks > 1:
        outs = [
            exchange_steps(exchange, *part, experts)
            for part in zip(
                jnp.split(x_TH, chunks), jnp.split(weights_TK, chunks), jnp.split(experts_TK, chunks)
            )
        ]
        return (jnp.concatenate([y for y, _ in outs]), moe_stats.combine_exchanges([s for _, s in outs]))
    with jax.named_scope("dispatch"):
        arrived, sent = exchange.dispatch(x_TH, weights_TK, experts_TK)
    y = expert_steps(arrived, experts)
    with jax.named_scope("combine"):
        return exchange.combine(y, sent)


def moe_steps(
    x_TH,
    xe_TH,
    gate_HE,
    experts: Experts,
    routing: Routing,
    exchange: Dispatcher,
    *,
    expert_bias=None,
    seq_len=None,
    axes=None,
    chunks: int = 1,
):
    """The whole pipeline on one shard's tokens: (y_TH, MoEStats over the whole batch).
    ``axes``: the mesh axes the batch is split over (inside ``shard_map``), else None."""
    with jax.named_scope("route"):
        weights_TK, experts_TK, stats = route_tokens(
            x_TH, gate_HE, routing, expert_bias=expert_bias, seq_len=seq_len, axis_names=axes
        )
    y_TH, ex = exchange_steps(exchange, xe_TH, weights_TK, experts_TK, experts, chunks)
    stats = stats.replace(**ex)
    return y_TH, stats if axes is None else moe_stats.across_shards(stats, axes)


def dropless_moe(
    x_TH,
    gate_kernel_HE,
    wi_0_EHF,
    wi_1_EHF,
    wo_EFH,
    routing: Routing,
    *,
    plan: EPPlan | None = None,
    expert_bias=None,
    backend="auto",
    tile_rows=None,
    seq_len=None,
    expert_input=None,
    platform: Platform | None = None,
):
    """Dropless top-k SwiGLU mixture of experts: on this device, or expert-parallel (``plan``).

    y[t] = sum over chosen e of w[t, e] * (silu(x[t] @ wi_0[e]) * (x[t] @ wi_1[e])) @ wo[e].

    Args:
      x_TH: activations [T, H] (leading dims [..., H] are flattened into T); bf16 or fp32.
        Expert matmuls run in this dtype with fp32 accumulation; y has this dtype.
      gate_kernel_HE, wi_0_EHF, wi_1_EHF, wo_EFH: router and expert weights (any float
        dtype; experts are cast to x's dtype, the router runs in fp32).
      routing: the router's settings (``router.Routing``).
      plan: None: one device (dispatch and combine are identities). An ``EPPlan``: the same
        pipeline on every shard of the context mesh under ``shard_map``, with the plan's
        dispatcher between the shards; ``x_TH`` is the global token batch (split over
        TOKEN_AXES), expert weights are split over EP_AXES; each shard routes its own tokens
        and the statistics are over the whole batch.
      expert_bias: [E] added to the scores for choosing only (aux-loss-free balancing).
      backend: one of BACKENDS ("auto" picks per platform, see gemm.resolve_backend).
      tile_rows: rows per tile of the tiled backend (None or 0: default_tile_rows).
      seq_len: rows per sequence for seq_aux_loss (None: all T rows are one sequence).
      expert_input: what the experts compute on in place of x_TH (same shape and dtype, e.g.
        an fp8 quantize-dequantized copy); routing always uses x_TH. None: x_TH.
      platform: the target "auto", the tiles and the kernels are chosen for (None: this
        process's, ``Platform.here()``).

    Returns:
      (y, stats): y shaped like x; stats a ``MoEStats`` (dropped_tokens is 0).
      ``stats.overflow``: some bucketed exchange needed more slots than it has: the train
      step keeps its old state and is rerun on a larger bucket, so no token is ever dropped.
    """
    H, E, F = check_expert_shapes(x_TH, gate_kernel_HE, wi_0_EHF, wi_1_EHF, wo_EFH)
    lead_shape = x_TH.shape[:-1]
    x_TH = x_TH.reshape(-1, H)
    xe_TH = x_TH if expert_input is None else expert_input.reshape(-1, H)
    on = or_here(platform)
    name = resolve_backend(backend, x_TH.dtype, hidden=H, ffn=F, platform=on)
    exchange, local_E, shards = shard_exchange(plan, E)
    chunks, axes = (1, None) if plan is None else (plan.chunks, TOKEN_AXES)
    # One tile size for every buffer size, so a bucket computes exactly what the worst case
    # does; a shard receives T*K rows when routing is balanced.
    tiles = row_tiles(name, tile_rows, x_TH.shape[0] // shards * routing.top_k // chunks, local_E, on)

    def shard(x_TH, xe_TH, gate_HE, w0, w1, wo, bias_E):
        return moe_steps(
            x_TH,
            xe_TH,
            gate_HE,
            Experts(w0, w1, wo, name, *tiles, platform=on),
            routing,
            exchange,
            expert_bias=bias_E,
            seq_len=seq_len,
            axes=axes,
            chunks=chunks,
        )

    operands = (x_TH, xe_TH, gate_kernel_HE, wi_0_EHF, wi_1_EHF, wo_EFH)
    if plan is None:
        y_TH, stats = shard(*operands, expert_bias)
    else:
        bias_E = jnp.zeros((E,), jnp.float32) if expert_bias is None else expert_bias
        y_TH, stats = shard_mapped(shard, name)(*operands, bias_E)
    return y_TH.reshape(*lead_shape, H), stats


def shard_exchange(plan: EPPlan | None, experts: int) -> tuple[Dispatcher, int, int]:
    """(dispatcher, experts per shard, shards of the token batch) of ``plan`` on the context
    mesh; without a plan, one device's: (``Local()``, ``experts``, 1)."""
    if plan is None:
        return Local(), experts, 1
    mesh = jax.sharding.get_abstract_mesh().shape
    local = experts // plan.ep
    return dispatcher(Context(plan, local, mesh[EXPERT_X], mesh[EXPERT])), local, math.prod(mesh.values())


def shard_mapped(shard, backend: str):
    """``shard(x_TH, xe_TH, gate_HE, wi_0, wi_1, wo, bias_E) -> (y_TH, MoEStats)`` under
    ``shard_map`` on the context mesh: each shard holds its tokens and its experts' whole weights."""
    tokens = logical_spec("activation_batch", "activation_embed")
    experts = logical_spec("expert", None, None)
    spec_of: dict[str, Any] = {k: P() for k in moe_stats.KIND}  # MoEStats as a pytree of specs
    stat_specs = moe_stats.MoEStats(**spec_of)
    # megablox's Pallas calls declare outputs without the mesh axes they vary along, which
    # shard_map's type check (check_vma) refuses; without it shard_map sums the replicated
    # inputs' gradients over the token axes itself (tests/test_megablox.py checks EP runs)
    return jax.shard_map(
        shard,
        in_specs=(tokens, tokens, P(), experts, experts, experts, P()),
        out_specs=(tokens, stat_specs),
        check_vma=backend != "megablox",
    )
